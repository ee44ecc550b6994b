"""Every loss against its formula written again here, on logprobs from plain transformers
(values) and from a peft model holding the same LoRA weights (values and gradients); the RL
losses with and without a `weights` mask."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from treadle.engine.types import LoraSpec, TrainBatch, TrainDatum
from treadle.errors import InvalidRequestError, NotFoundError

RANK, ALPHA = 4, 8.0
LENGTHS = (6, 9)


# ---- the formulas, independently of treadle.engine.losses ----
def formula(case: str, lp: torch.Tensor, x: dict[str, torch.Tensor]) -> torch.Tensor:
    if case.startswith("cross_entropy"):
        return (-lp * x["weights"]).sum()
    w = x.get("weights", torch.ones_like(lp))
    return (per_token(case, lp, x) * w).sum()


def per_token(case: str, lp: torch.Tensor, x: dict[str, torch.Tensor]) -> torch.Tensor:
    """The unweighted per-token value of an RL loss, written from its documented formula."""
    name, cfg = LOSS_NAME.get(case, case), CONFIG[case]
    adv = x["advantages"]
    if name == "stable_reinforce":
        q, m = x["recorded_logprobs"], x["recorded_mask"]
        rho = torch.exp(lp - q)
        on = m == 1
        term = -torch.minimum(rho.detach(), torch.tensor(1.0)) * adv * lp
        term = term + cfg.get("kl_coeff", 0.1) * (rho - 1 - (lp - q))
        return torch.where(on, term, torch.zeros_like(term))
    s = x["logprobs"]
    r = torch.exp(lp - s)
    if name == "importance_sampling":
        return -(r * adv)
    lo = x.get("clip_low_threshold", torch.tensor(cfg.get("clip_low_threshold", 0.8)))
    hi = x.get("clip_high_threshold", torch.tensor(cfg.get("clip_high_threshold", 1.2)))
    if name == "gspo":
        # the sequence ratio's value over the marked tokens, each token's own gradient
        marked = x["sequence_ratio_mask"] != 0 if "sequence_ratio_mask" in x else adv != 0
        seq = (lp.detach() - s)[marked].mean() if marked.any() else torch.tensor(0.0)
        r = torch.exp(seq) * torch.exp(lp) / torch.exp(lp.detach())
    clipped = torch.maximum(torch.minimum(r, hi), lo)
    if name in ("ppo", "gspo"):
        return -torch.minimum(r * adv, clipped * adv)
    if name == "cispo":
        return -(clipped.detach() * lp * adv)
    if name == "dro":
        beta = cfg.get("beta", 0.1)
        return -(lp * adv - 0.5 * beta * (lp - s) ** 2)
    raise AssertionError(case)


CONFIG = {
    "cross_entropy": {},
    "cross_entropy_topk": {},
    "importance_sampling": {},
    "ppo": {},
    "ppo_config": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
    "ppo_per_token": {},
    "cispo": {"clip_low_threshold": 0.85, "clip_high_threshold": 1.15},
    "dro": {"beta": 0.3},
    "dro_default": {},
    "gspo": {},
    "gspo_mask": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
    "stable_reinforce": {},
    "stable_reinforce_kl": {"kl_coeff": 0.7},
    "importance_sampling_weights": {},
    "ppo_weights": {},
    "cispo_weights": {"clip_low_threshold": 0.85, "clip_high_threshold": 1.15},
    "dro_weights": {"beta": 0.3},
    "gspo_weights": {},
    "stable_reinforce_weights": {},
}
LOSS_NAME = {
    "cross_entropy_topk": "cross_entropy",
    "ppo_config": "ppo",
    "ppo_per_token": "ppo",
    "dro_default": "dro",
    "gspo_mask": "gspo",
    "stable_reinforce_kl": "stable_reinforce",
    **{f"{n}_weights": n for n in ("importance_sampling", "ppo", "cispo", "dro", "gspo")},
    "stable_reinforce_weights": "stable_reinforce",
}
RL_LOSSES = ("importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce")
PROMPT = 3  # leading positions that play the prompt: advantage 0, weight 0, not sampled


def _make_data(case: str, ref_lp: list[torch.Tensor], tokens, targets, seed: int):
    """Datums whose sampler logprobs sit around the reference, so ratios cross the clip range.

    RL datums lay out a prompt (the first PROMPT positions, advantage 0) then sampled tokens;
    `_weights` cases mask the prompt with weight 0 and give the rest weights in (0, 2)."""
    rng = np.random.default_rng(seed)
    name = LOSS_NAME.get(case, case)
    data = []
    for toks, tgt, lp in zip(tokens, targets, ref_lp, strict=True):
        T = len(toks)
        if case.startswith("cross_entropy"):
            w = rng.normal(size=tgt.shape).astype(np.float32)  # negative weights too
            data.append(TrainDatum(toks, {"target_tokens": tgt, "weights": w}))
            continue
        drift = rng.uniform(-0.4, 0.4, T)
        if name == "gspo":  # one sequence ratio outside the clip range (exp(-0.3)), one inside
            drift = 0.3 * (len(data) == 0) + 0.3 * drift
        s = np.minimum(lp.detach().numpy() + drift, 0).astype(np.float32)
        adv = rng.normal(size=T).astype(np.float32)
        if name in ("gspo", "stable_reinforce") or case.endswith("_weights"):
            adv[:PROMPT] = 0.0
        inputs = {"target_tokens": tgt, "logprobs": s, "advantages": adv}
        if case == "ppo_per_token":
            inputs["clip_low_threshold"] = rng.uniform(0.7, 0.95, T).astype(np.float32)
            inputs["clip_high_threshold"] = rng.uniform(1.05, 1.3, T).astype(np.float32)
        if case == "gspo_mask":  # the ratio over a part of the sampled tokens only
            inputs["sequence_ratio_mask"] = (np.arange(T) >= PROMPT + 1).astype(np.float32)
        if name == "stable_reinforce":  # what the server adds from provenance
            inputs["recorded_logprobs"] = np.where(np.arange(T) < PROMPT, 0.0, s).astype(np.float32)
            inputs["recorded_mask"] = (np.arange(T) >= PROMPT).astype(np.float32)
            if case != "stable_reinforce_weights":
                del inputs["logprobs"]  # optional: the recorded ones are used
        if case.endswith("_weights"):
            w = rng.uniform(0.0, 2.0, T).astype(np.float32)
            w[:PROMPT] = 0.0
            inputs["weights"] = w
        data.append(TrainDatum(toks, inputs))
    return data


def _tokens(engine, case: str, seed: int):
    rng = np.random.default_rng(seed)
    tokens, targets = [], []
    for T in LENGTHS:
        tokens.append(rng.integers(0, engine.vocab_size, T))
        shape = (T, 3) if case == "cross_entropy_topk" else (T,)
        targets.append(rng.integers(0, engine.vocab_size, shape))
    return tokens, targets


def _torch_inputs(datum: TrainDatum) -> dict[str, torch.Tensor]:
    return {
        k: torch.as_tensor(np.asarray(v, dtype=np.float32)).clone()
        for k, v in datum.loss_inputs.items()
        if k != "target_tokens"
    }


@pytest.fixture(scope="module")
def peft_model(model_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules=targets + ["lm_head"], lora_dropout=0.0
    )
    model = get_peft_model(base, config)
    model.eval()
    return model


def _copy_into_peft(peft_model, adapter) -> None:
    inner = peft_model.base_model.model
    with torch.no_grad():
        for path, pair in adapter.layers.items():
            module = inner.get_submodule(path)
            module.lora_A["default"].weight.copy_(pair.A)
            module.lora_B["default"].weight.copy_(pair.B)
            module.lora_A["default"].weight.grad = None
            module.lora_B["default"].weight.grad = None


@pytest.mark.parametrize("case", list(CONFIG))
def test_value_on_plain_transformers_logprobs(engine, plain_model, helpers, new_id, case):
    """A fresh adapter is the base: loss and logprobs equal the formula on plain transformers."""
    aid = new_id()
    engine.create_adapter(aid, LoraSpec(rank=RANK, alpha=ALPHA, seed=1))
    tokens, targets = _tokens(engine, case, seed=2)
    with torch.no_grad():
        ref_lp = [
            helpers.plain_logprobs(plain_model, t, g) for t, g in zip(tokens, targets, strict=True)
        ]
    data = _make_data(case, ref_lp, tokens, targets, seed=3)
    xs = [_torch_inputs(d) for d in data]  # as sent (the engine fills optional defaults)
    batch = TrainBatch(aid, data, LOSS_NAME.get(case, case), CONFIG[case])
    (result,) = engine.forward_backward([batch], forward_only=True)
    expected = sum(float(formula(case, lp, x)) for lp, x in zip(ref_lp, xs, strict=True))
    assert result.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5, abs=1e-4)
    for out, lp, tgt in zip(result.outputs, ref_lp, targets, strict=True):
        assert out["logprobs"].shape == tgt.shape
        assert out["logprobs"].dtype == np.float32
        np.testing.assert_allclose(out["logprobs"], lp.numpy(), rtol=1e-5, atol=1e-5)
    engine.drop_adapter(aid)


@pytest.mark.parametrize("case", list(CONFIG))
def test_value_and_gradient_against_peft(engine, peft_model, helpers, new_id, case):
    """Same LoRA weights in peft: the formula's autograd gradients equal the engine's."""
    aid = new_id()
    engine.create_adapter(aid, LoraSpec(rank=RANK, alpha=ALPHA, seed=4))
    adapter = engine.bank.live(aid)
    helpers.perturb(adapter, seed=5)
    _copy_into_peft(peft_model, adapter)
    tokens, targets = _tokens(engine, case, seed=6)
    with torch.no_grad():
        lp0 = [
            helpers.plain_logprobs(peft_model, t, g) for t, g in zip(tokens, targets, strict=True)
        ]
    data = _make_data(case, lp0, tokens, targets, seed=7)
    xs = [_torch_inputs(d) for d in data]

    (result,) = engine.forward_backward(
        [TrainBatch(aid, data, LOSS_NAME.get(case, case), CONFIG[case])]
    )

    total = torch.zeros(())
    ratios = []
    for t, g, x in zip(tokens, targets, xs, strict=True):
        lp = helpers.plain_logprobs(peft_model, t, g)
        total = total + formula(case, lp, x)
        if "logprobs" in x:
            ratios.append(torch.exp(lp.detach() - x["logprobs"]))
    total.backward()
    assert result.metrics["loss:sum"] == pytest.approx(total.item(), rel=1e-5, abs=1e-4)
    if case.startswith(("ppo", "cispo")) and not case.endswith("_weights"):
        r = torch.cat(ratios)
        clipped = ((r < 0.8) | (r > 1.2)).float().mean()
        assert 0 < clipped < 1  # some tokens are clipped, some are not
    if case.startswith("gspo"):  # one sequence's ratio is clipped, the other's is not
        seq = [float(r[PROMPT + 1 :].log().mean().exp()) for r in ratios]
        lo = CONFIG[case].get("clip_low_threshold", 0.8)
        assert seq[0] < lo < seq[1], seq
    inner = peft_model.base_model.model
    for path, pair in adapter.layers.items():
        module = inner.get_submodule(path)
        for ours, theirs in (
            (pair.A, module.lora_A["default"].weight),
            (pair.B, module.lora_B["default"].weight),
        ):
            torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-4, atol=1e-6)
    assert any(p.grad.abs().max() > 0 for p in adapter.parameters())
    engine.drop_adapter(aid)


# ---- weights ----
def _rl_case_data(engine, name: str, seed: int, weights: np.ndarray | None = None):
    tokens, targets = _tokens(engine, name, seed)
    rng = np.random.default_rng(seed)
    lp = [torch.as_tensor(rng.uniform(-8, -3, len(t)), dtype=torch.float32) for t in tokens]
    data = _make_data(name, lp, tokens, targets, seed + 1)
    if weights is not None:
        for d in data:
            d.loss_inputs["weights"] = weights[: len(d.tokens)].copy()
    return data


def _grads(engine, aid: str, name: str, data) -> tuple[float, list[torch.Tensor]]:
    adapter = engine.bank.live(aid)
    for p in adapter.parameters():
        p.grad = None
    (res,) = engine.forward_backward([TrainBatch(aid, data, name, CONFIG[name])])
    grads = [p.grad.clone() for p in adapter.parameters()]
    for p in adapter.parameters():
        p.grad = None
    return res.metrics["loss:sum"], grads


@pytest.mark.parametrize("name", RL_LOSSES)
def test_all_weights_one_is_the_unweighted_loss(engine, helpers, new_id, name):
    aid = new_id()
    engine.create_adapter(aid, LoraSpec(rank=RANK, alpha=ALPHA, seed=8))
    helpers.perturb(engine.bank.live(aid), seed=9)
    loss, grads = _grads(engine, aid, name, _rl_case_data(engine, name, 10))
    ones = np.ones(max(LENGTHS), np.float32)
    loss_w, grads_w = _grads(engine, aid, name, _rl_case_data(engine, name, 10, ones))
    assert loss_w == loss
    for g, gw in zip(grads, grads_w, strict=True):
        torch.testing.assert_close(g, gw, rtol=0, atol=0)
    engine.drop_adapter(aid)


@pytest.mark.parametrize("name", RL_LOSSES)
def test_masked_tokens_have_no_gradient(engine, helpers, new_id, name):
    """Weight 0 on the prompt: d loss / d lp is exactly 0 there, and the adapter's gradient
    does not depend on what the masked positions hold."""
    from treadle.engine.losses import LOSSES

    T = 8
    rng = np.random.default_rng(11)
    lp = torch.tensor(rng.uniform(-6, -1, (1, T)), dtype=torch.float32, requires_grad=True)
    w = np.ones(T, np.float32)
    w[:PROMPT] = 0.0
    x = {
        "logprobs": torch.tensor(rng.uniform(-6, -1, (1, T)), dtype=torch.float32),
        "advantages": torch.tensor(rng.normal(size=(1, T)), dtype=torch.float32),
        "weights": torch.tensor(w[None]),
        "sequence_ratio_mask": torch.ones(1, T),
        "recorded_logprobs": torch.tensor(rng.uniform(-6, -1, (1, T)), dtype=torch.float32),
        "recorded_mask": torch.ones(1, T),
    }
    LOSSES[name].fn(lp, x, {}).sum().backward()
    assert (lp.grad[0, :PROMPT] == 0).all() and (lp.grad[0, PROMPT:] != 0).any()

    aid = new_id()
    engine.create_adapter(aid, LoraSpec(rank=RANK, alpha=ALPHA, seed=12))
    helpers.perturb(engine.bank.live(aid), seed=13)
    mask = np.ones(max(LENGTHS), np.float32)
    mask[:PROMPT] = 0.0
    data = _rl_case_data(engine, name, 14, mask)
    loss, grads = _grads(engine, aid, name, data)
    scrambled = _rl_case_data(engine, name, 14, mask)
    for d in scrambled:  # other logprobs and advantages under the mask
        if "logprobs" in d.loss_inputs:
            d.loss_inputs["logprobs"][:PROMPT] -= 2.0
        # stable_reinforce takes advantage 0 off sampled tokens only; gspo's default ratio
        # mask is the nonzero advantages (weights never change which tokens the ratio spans)
        if name not in ("stable_reinforce", "gspo"):
            d.loss_inputs["advantages"][:PROMPT] = 5.0
    loss2, grads2 = _grads(engine, aid, name, scrambled)
    assert loss2 == pytest.approx(loss, rel=1e-6, abs=1e-6)
    for g, g2 in zip(grads, grads2, strict=True):
        torch.testing.assert_close(g, g2, rtol=1e-5, atol=1e-7)
    engine.drop_adapter(aid)


# ---- bad inputs ----
def _datum(T: int = 8) -> TrainDatum:
    tokens = np.arange(T) % 50
    return TrainDatum(tokens, {"target_tokens": tokens.copy(), "weights": np.ones(T, np.float32)})


def _rl_datum(T: int = 8) -> TrainDatum:
    tokens = np.arange(T) % 50
    inputs = {
        "target_tokens": tokens.copy(),
        "logprobs": np.full(T, -1.0, np.float32),
        "advantages": np.ones(T, np.float32),
    }
    return TrainDatum(tokens, inputs)


@pytest.fixture(scope="module")
def bad_id(engine):
    engine.create_adapter("bad-inputs", LoraSpec(rank=2))
    yield "bad-inputs"
    engine.drop_adapter("bad-inputs")


def _raises(engine, batch: TrainBatch, message: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        engine.forward_backward([batch])
    assert message in str(err.value), str(err.value)


def test_unknown_loss(engine, bad_id):
    _raises(engine, TrainBatch(bad_id, [_datum()], "ppo2"), "loss_fn must be one of")


def test_missing_key(engine, bad_id):
    d = _rl_datum()
    del d.loss_inputs["advantages"]
    _raises(engine, TrainBatch(bad_id, [d], "ppo"), "loss_fn_inputs is missing 'advantages'")


def test_weights_shape(engine, bad_id):
    d = _datum(8)
    d.loss_inputs["weights"] = np.ones(7, np.float32)
    _raises(
        engine,
        TrainBatch(bad_id, [_datum(), d]),
        "datum 1: loss_fn_inputs['weights'] has shape (7,), expected (8,) to match target_tokens",
    )


def test_target_tokens_shape(engine, bad_id):
    d = _datum(8)
    d.loss_inputs["target_tokens"] = d.loss_inputs["target_tokens"][:5]
    _raises(
        engine,
        TrainBatch(bad_id, [d]),
        "loss_fn_inputs['target_tokens'] has shape (5,), expected (8,) or (8, K) to match model_input",
    )
    d = _rl_datum(8)
    d.loss_inputs["target_tokens"] = np.zeros((8, 2), np.int64)  # top-K is cross_entropy only
    _raises(
        engine,
        TrainBatch(bad_id, [d], "importance_sampling"),
        "loss_fn_inputs['target_tokens'] has shape (8, 2), expected (8,) to match model_input",
    )


def test_wrong_rank_advantages(engine, bad_id):
    d = _rl_datum(8)
    d.loss_inputs["advantages"] = np.ones((8, 1), np.float32)
    _raises(
        engine,
        TrainBatch(bad_id, [d], "ppo"),
        "loss_fn_inputs['advantages'] has shape (8, 1), expected (8,) to match model_input",
    )


def test_token_ids_in_vocab(engine, bad_id):
    d = _datum(8)
    d.tokens = d.tokens.copy()
    d.tokens[3] = engine.vocab_size
    _raises(
        engine,
        TrainBatch(bad_id, [d]),
        f"model_input holds token id {engine.vocab_size}, expected ids in [0, {engine.vocab_size})",
    )
    d = _datum(8)
    d.loss_inputs["target_tokens"] = d.loss_inputs["target_tokens"] - 10
    _raises(engine, TrainBatch(bad_id, [d]), "loss_fn_inputs['target_tokens'] holds token id -")


def test_lengths_and_types(engine, bad_id):
    _raises(
        engine,
        TrainBatch(bad_id, [_datum(engine.max_seq_len + 1)]),
        f"1 <= T <= {engine.max_seq_len}",
    )
    _raises(engine, TrainBatch(bad_id, []), "data must hold at least one datum")
    d = _datum(4)
    d.loss_inputs["target_tokens"] = np.array([0.5, 1, 2, 3])
    _raises(engine, TrainBatch(bad_id, [d]), "must hold integer token ids")
    d = _rl_datum(4)
    d.loss_inputs["advantages"] = np.array([1, np.nan, 0, 0], np.float32)
    _raises(
        engine,
        TrainBatch(bad_id, [d], "ppo"),
        "loss_fn_inputs['advantages'] must hold finite numbers",
    )


def test_config_and_extra_keys(engine, bad_id):
    _raises(
        engine,
        TrainBatch(bad_id, [_rl_datum()], "ppo", {"clip_low": 0.5}),
        "loss_fn_config['clip_low'] is not a setting of ppo",
    )
    _raises(
        engine,
        TrainBatch(bad_id, [_rl_datum()], "ppo", {"clip_low_threshold": 1.5}),
        "clip_low_threshold <= clip_high_threshold",
    )
    d = _datum()
    d.loss_inputs["mask"] = np.ones(8, np.float32)
    _raises(engine, TrainBatch(bad_id, [d]), "loss_fn_inputs has unexpected key 'mask'")


def test_bad_batch_leaves_no_gradient(engine, bad_id, new_id):
    """All batches are checked before the pass: one bad session fails the call cleanly."""
    bad = _datum(8)
    bad.loss_inputs["weights"] = np.ones(3, np.float32)
    with pytest.raises(InvalidRequestError):
        engine.forward_backward([TrainBatch(bad_id, [_datum()]), TrainBatch(bad_id, [bad])])
    assert all(p.grad is None for p in engine.bank.live(bad_id).parameters())
    with pytest.raises(NotFoundError, match="no-such-adapter"):
        engine.forward_backward([TrainBatch("no-such-adapter", [_datum()])])
    snap = new_id("snap")
    engine.snapshot(bad_id, snap)
    with pytest.raises(NotFoundError, match=snap):
        engine.forward_backward([TrainBatch(snap, [_datum()])])
    (res,) = engine.forward_backward([TrainBatch(snap, [_datum()])], forward_only=True)
    assert res.outputs[0]["logprobs"].shape == (8,)
    engine.drop_snapshot(snap)


def test_provenance_inputs(engine, bad_id):
    """The recorded inputs come from the server only; stable_reinforce needs them and takes
    advantages on sampled tokens only."""
    from treadle.engine.specs import validate_train_batch

    d = _rl_datum(8)
    d.loss_inputs["recorded_logprobs"] = np.full(8, -1.0, np.float32)
    d.loss_inputs["recorded_mask"] = np.ones(8, np.float32)
    with pytest.raises(InvalidRequestError, match="unexpected key 'recorded_logprobs'"):
        validate_train_batch([d], "stable_reinforce", {}, engine.vocab_size, 64)
    validate_train_batch([d], "stable_reinforce", {}, engine.vocab_size, 64, recorded=True)
    with pytest.raises(InvalidRequestError, match="unexpected key 'recorded_logprobs'"):
        validate_train_batch([d], "ppo", {}, engine.vocab_size, 64, recorded=True)
    d.loss_inputs["recorded_mask"][:2] = 0.0
    _raises(
        engine,
        TrainBatch(bad_id, [d], "stable_reinforce"),
        "loss_fn_inputs['advantages'][0] is 1 at a position whose target is not a sampled token",
    )
    del d.loss_inputs["recorded_mask"]
    _raises(
        engine,
        TrainBatch(bad_id, [d], "stable_reinforce"),
        "loss_fn_inputs is missing 'recorded_mask'",
    )
    _raises(
        engine,
        TrainBatch(bad_id, [_rl_datum()], "stable_reinforce", {"kl_coeff": -1.0}),
        "loss_fn_config['kl_coeff'] must be >= 0",
    )
