"""Every loss against its formula written again here, on logprobs from plain transformers
(values) and from a peft model holding the same LoRA weights (values and gradients)."""

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
    s, adv = x["logprobs"], x["advantages"]
    r = torch.exp(lp - s)
    if case == "importance_sampling":
        return -(r * adv).sum()
    lo = x.get("clip_low_threshold", torch.tensor(CONFIG[case].get("clip_low_threshold", 0.8)))
    hi = x.get("clip_high_threshold", torch.tensor(CONFIG[case].get("clip_high_threshold", 1.2)))
    clipped = torch.maximum(torch.minimum(r, hi), lo)
    if case.startswith("ppo"):
        return -torch.minimum(r * adv, clipped * adv).sum()
    if case == "cispo":
        return -(clipped.detach() * lp * adv).sum()
    if case.startswith("dro"):
        beta = CONFIG[case].get("beta", 0.1)
        return -(lp * adv - 0.5 * beta * (lp - s) ** 2).sum()
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
}
LOSS_NAME = {
    "cross_entropy_topk": "cross_entropy",
    "ppo_config": "ppo",
    "ppo_per_token": "ppo",
    "dro_default": "dro",
}


def _make_data(case: str, ref_lp: list[torch.Tensor], tokens, targets, seed: int):
    """Datums whose sampler logprobs sit around the reference, so ratios cross the clip range."""
    rng = np.random.default_rng(seed)
    data = []
    for toks, tgt, lp in zip(tokens, targets, ref_lp, strict=True):
        T = len(toks)
        if case.startswith("cross_entropy"):
            w = rng.normal(size=tgt.shape).astype(np.float32)  # negative weights too
            inputs = {"target_tokens": tgt, "weights": w}
        else:
            s = lp.detach().numpy() + rng.uniform(-0.4, 0.4, T).astype(np.float32)
            inputs = {
                "target_tokens": tgt,
                "logprobs": s.astype(np.float32),
                "advantages": rng.normal(size=T).astype(np.float32),
            }
            if case == "ppo_per_token":
                inputs["clip_low_threshold"] = rng.uniform(0.7, 0.95, T).astype(np.float32)
                inputs["clip_high_threshold"] = rng.uniform(1.05, 1.3, T).astype(np.float32)
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
        k: torch.as_tensor(np.asarray(v, dtype=np.float32))
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
    batch = TrainBatch(aid, data, LOSS_NAME.get(case, case), CONFIG[case])
    (result,) = engine.forward_backward([batch], forward_only=True)
    expected = sum(
        float(formula(case, lp, _torch_inputs(d))) for lp, d in zip(ref_lp, data, strict=True)
    )
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

    (result,) = engine.forward_backward(
        [TrainBatch(aid, data, LOSS_NAME.get(case, case), CONFIG[case])]
    )

    total = torch.zeros(())
    ratios = []
    for t, g, d in zip(tokens, targets, data, strict=True):
        lp = helpers.plain_logprobs(peft_model, t, g)
        x = _torch_inputs(d)
        total = total + formula(case, lp, x)
        if "logprobs" in x:
            ratios.append(torch.exp(lp.detach() - x["logprobs"]))
    total.backward()
    assert result.metrics["loss:sum"] == pytest.approx(total.item(), rel=1e-5, abs=1e-4)
    if case.startswith(("ppo", "cispo")):
        r = torch.cat(ratios)
        clipped = ((r < 0.8) | (r > 1.2)).float().mean()
        assert 0 < clipped < 1  # some tokens are clipped, some are not
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
