"""Long sequences in bounded memory: chunked target logprobs against the full logits,
checkpointed layers against unchecked ones, several passes against one, the refusal of a
sequence the budget cannot hold, and a sequence past the model's context against plain
transformers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from treadle.engine import logprobs, train, train_passes
from treadle.engine.memory import MemoryPlan, MemorySettings, ModelShape
from treadle.engine.types import AdamSpec, LoraSpec, TrainBatch, TrainDatum
from treadle.errors import InvalidRequestError


def _grads(engine, aid: str) -> list[torch.Tensor]:
    return [p.grad.clone() for p in engine.bank.live(aid).parameters()]


def _clear(engine, *aids: str) -> None:
    for aid in aids:
        for p in engine.bank.live(aid).parameters():
            p.grad = None


def _close(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    """Equal to fp32 rounding (the same sums in another order: atol grows with the size)."""
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5 * max(1.0, y.abs().max().item()))


def full_logits_pass(model, bank, batches, keys, layers=None, checkpointed=False, hidden=None):
    """The computation the engine did before: the whole (B, T, V) logits with the padding
    mask, log_softmax, gather. The reference the chunked path is held to."""
    lengths = [len(d.tokens) for b in batches for d in b.data]
    B, T = len(lengths), max(lengths)
    ids = torch.zeros((B, T), dtype=torch.long)  # (B, T)
    for r, d in enumerate(d for b in batches for d in b.data):
        ids[r, : len(d.tokens)] = torch.as_tensor(np.asarray(d.tokens, dtype=np.int64))
    mask = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).long()  # (B, T)
    with bank.rows(keys):
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits  # (B, T, V)
    logp = logits.float().log_softmax(-1)
    targets = [train._targets(b, T, ids.device) for b in batches]
    pieces = logp.split([len(b.data) for b in batches])
    lps = [
        x.gather(-1, t.padded) if t.top_k else x.gather(-1, t.padded[..., None])[..., 0]
        for x, t in zip(pieces, targets, strict=True)
    ]
    return lps, targets, lengths


def _rl_datum(rng, vocab: int, T: int, loss_fn: str) -> TrainDatum:
    seq = rng.integers(0, vocab, T + 1)
    x = {"target_tokens": seq[1:]}
    if loss_fn == "cross_entropy":
        x["weights"] = rng.random(T).astype(np.float32)
        return TrainDatum(seq[:-1], x)
    if loss_fn == "top_k":
        x["target_tokens"] = rng.integers(0, vocab, (T, 3))
        x["weights"] = rng.random((T, 3)).astype(np.float32)
        return TrainDatum(seq[:-1], x)
    x["advantages"] = rng.normal(size=T).astype(np.float32)
    x["logprobs"] = (-rng.random(T) * 3 - 5).astype(np.float32)
    if loss_fn == "stable_reinforce":
        x["recorded_logprobs"] = x["logprobs"].copy()
        x["recorded_mask"] = (rng.random(T) > 0.3).astype(np.float32)
        x["advantages"] *= x["recorded_mask"]  # advantages on sampled tokens only
    return TrainDatum(seq[:-1], x)


LOSS_CASES = ["cross_entropy", "top_k", "importance_sampling", "ppo", "cispo", "dro", "gspo"]
LOSS_CASES += ["stable_reinforce"]


@pytest.mark.parametrize("loss_fn", LOSS_CASES)
def test_chunked_logprobs_equal_the_full_logits(engine, helpers, new_id, monkeypatch, loss_fn):
    """Two sessions in one call (one with a LoRA on the unembedding), positions in chunks of
    a few tokens: values, logprobs and gradients of every loss equal the full-logits path."""
    ids = [new_id(), new_id()]
    engine.create_adapter(ids[0], LoraSpec(rank=4, seed=1, train_unembed=True))
    engine.create_adapter(ids[1], LoraSpec(rank=2, seed=2, train_unembed=False))
    for k, aid in enumerate(ids):
        helpers.perturb(engine.bank.live(aid), seed=k)
    rng = np.random.default_rng(7)
    name = "cross_entropy" if loss_fn == "top_k" else loss_fn
    batches = [
        TrainBatch(ids[0], [_rl_datum(rng, engine.vocab_size, T, loss_fn) for T in (11, 6)], name),
        TrainBatch(ids[1], [_rl_datum(rng, engine.vocab_size, 9, "cross_entropy")]),
    ]
    # 3 positions per chunk for these 3 rows: every datum spans several chunks
    monkeypatch.setattr(logprobs, "CHUNK_BYTES", 3 * 3 * engine.vocab_size * 4)
    chunked = engine.forward_backward(batches)
    got = {aid: _grads(engine, aid) for aid in ids}
    _clear(engine, *ids)
    monkeypatch.setattr(train, "model_pass", full_logits_pass)
    full = engine.forward_backward(batches)
    for a, b in zip(chunked, full, strict=True):
        assert a.metrics["loss:sum"] == pytest.approx(b.metrics["loss:sum"], rel=1e-5, abs=1e-5)
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert x["logprobs"].shape == y["logprobs"].shape
            np.testing.assert_allclose(x["logprobs"], y["logprobs"], rtol=1e-5, atol=1e-5)
    for aid in ids:
        _close(got[aid], _grads(engine, aid))
        assert all(g.abs().max() > 0 for g in got[aid])
        engine.drop_adapter(aid)


def _saved_bytes(fn) -> int:
    """Bytes autograd keeps outside checkpointed regions during fn (tensors saved inside
    one are the checkpoint's own business: it drops them)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def _plan(engine, **settings) -> MemoryPlan:
    return MemoryPlan(ModelShape.of(engine.model), MemorySettings(**settings), "cpu")


def test_checkpointed_layers_give_the_same_gradients(engine, helpers, sft_datum, new_id):
    """Three sessions, one call: checkpointing on gives the unchecked call's gradients and
    logprobs, while autograd keeps a fraction of the tensors."""
    ids = [new_id() for _ in range(3)]
    specs = [LoraSpec(rank=4, seed=1), LoraSpec(rank=2, seed=2, train_mlp=False)]
    specs.append(LoraSpec(rank=8, seed=3, train_unembed=False))
    for k, (aid, spec) in enumerate(zip(ids, specs, strict=True)):
        engine.create_adapter(aid, spec)
        helpers.perturb(engine.bank.live(aid), seed=k)
    batches = [TrainBatch(aid, [sft_datum(40 + 7 * k, seed=k)]) for k, aid in enumerate(ids)]
    active = []
    layer = engine.layer_checkpointing.layers[0]
    hook = layer.register_forward_pre_hook(
        lambda *_: active.append(engine.layer_checkpointing.active)
    )
    results, grads, saved = {}, {}, {}
    try:
        for mode in ("off", "on"):
            engine.memory_plan = _plan(engine, checkpointing=mode)
            _clear(engine, *ids)
            saved[mode] = _saved_bytes(lambda m=mode: results.__setitem__(m, _fb(engine, batches)))
            grads[mode] = {aid: _grads(engine, aid) for aid in ids}
    finally:
        hook.remove()
        engine.memory_plan = _plan(engine)
    assert active[0] is False and True in active  # off, then on (and its recomputation)
    assert saved["on"] < saved["off"] / 3
    for a, b in zip(results["on"], results["off"], strict=True):
        assert a.metrics["loss:sum"] == pytest.approx(b.metrics["loss:sum"], rel=1e-6)
        np.testing.assert_allclose(a.outputs[0]["logprobs"], b.outputs[0]["logprobs"], atol=1e-6)
    for aid in ids:
        _close(grads["on"][aid], grads["off"][aid])
        engine.drop_adapter(aid)


def _fb(engine, batches):
    return engine.forward_backward(batches)


def test_auto_checkpoints_only_what_exceeds_its_threshold(engine):
    shape = ModelShape.of(engine.model)
    threshold = shape.activations(500, checkpointed=False, train=True)
    plan = MemoryPlan(shape, MemorySettings("auto", 1 << 40, threshold), "cpu")
    assert not plan.checkpoints(500, True) and plan.checkpoints(501, True)
    assert not plan.checkpoints(10_000, train=False)  # no gradients: nothing to keep
    budget = shape.weight_bytes + shape.activations(2000, checkpointed=False, train=True)
    on, off = (MemoryPlan(shape, MemorySettings(m, budget), "cpu") for m in ("on", "off"))
    assert off.max_tokens == 2000 and on.max_tokens > off.max_tokens
    auto = MemoryPlan(shape, MemorySettings("auto", budget), "cpu")
    assert auto.max_tokens == on.max_tokens  # auto checkpoints whatever would not fit
    with pytest.raises(ValueError, match="off, on, auto|one of"):
        MemorySettings("sometimes")


def test_a_call_larger_than_one_pass_runs_as_several(engine, helpers, sft_datum, new_id):
    """A budget of about 90 tokens per pass: 6 rows of 2 sessions (one cut across passes)
    give the one-pass results and gradients."""
    a, b = new_id(), new_id()
    engine.create_adapter(a, LoraSpec(rank=4, seed=1))
    engine.create_adapter(b, LoraSpec(rank=2, seed=2, train_unembed=False))
    for k, aid in enumerate((a, b)):
        helpers.perturb(engine.bank.live(aid), seed=k)
    batches = [
        TrainBatch(a, [sft_datum(T, seed=T) for T in (30, 25, 40, 20)]),
        TrainBatch(b, [sft_datum(T, seed=T) for T in (35, 28)]),
    ]
    shape = ModelShape.of(engine.model)
    small = MemoryPlan(
        shape, MemorySettings("off", shape.weight_bytes + shape.activations(90, False, True))
    )
    assert len(train_passes.plan_passes(batches, small, True)) >= 3
    one = engine.forward_backward(batches)
    once = {aid: _grads(engine, aid) for aid in (a, b)}
    _clear(engine, a, b)
    engine.memory_plan = small
    try:
        several = engine.forward_backward(batches)
        forward = engine.forward_backward(batches, forward_only=True)
    finally:
        engine.memory_plan = _plan(engine)
    for x, y, z in zip(one, several, forward, strict=True):
        assert x.metrics["loss:sum"] == pytest.approx(y.metrics["loss:sum"], rel=1e-5)
        assert y.metrics["nonfinite:sum"] == 0.0
        for p, q, r in zip(x.outputs, y.outputs, z.outputs, strict=True):
            np.testing.assert_allclose(p["logprobs"], q["logprobs"], rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(p["logprobs"], r["logprobs"], rtol=1e-5, atol=1e-5)
    for aid in (a, b):
        _close(once[aid], _grads(engine, aid))
        engine.drop_adapter(aid)


def test_a_sequence_the_budget_cannot_hold_is_refused(engine, sft_datum, new_id):
    aid = new_id()
    engine.create_adapter(aid, LoraSpec(rank=4, seed=1))
    shape = ModelShape.of(engine.model)
    engine.memory_plan = MemoryPlan(
        shape, MemorySettings("on", shape.weight_bytes + shape.activations(100, True, True))
    )
    try:
        limit = engine.memory_plan.max_tokens
        assert 90 <= limit <= 110
        with pytest.raises(InvalidRequestError) as err:
            engine.forward_backward([TrainBatch(aid, [sft_datum(20, 1), sft_datum(300, 2)])])
        assert "datum 1: model_input: length 300 exceeds" in str(err.value)
        assert f"limit of {limit} tokens" in str(
            err.value
        ) and "activation checkpointing on" in str(err.value)
        assert all(p.grad is None for p in engine.bank.live(aid).parameters())  # nothing ran
        (ok,) = engine.forward_backward([TrainBatch(aid, [sft_datum(limit, 3)])])
        assert np.isfinite(ok.metrics["loss:sum"])
        engine.optim_step(aid, AdamSpec(learning_rate=1e-3))
    finally:
        engine.memory_plan = _plan(engine)
        engine.drop_adapter(aid)


def test_past_the_context_with_checkpointing_equals_plain_transformers(model_dir, plain_model):
    """max_seq_len raised past the tiny model's 1024 positions: a 1500-token datum, layers
    checkpointed and logits in chunks, scores as plain transformers does."""
    from treadle.engine import Engine

    engine = Engine(model_dir, memory=MemorySettings("on"), max_seq_len=2048)
    assert engine.max_seq_len == 2048 > plain_model.config.max_position_embeddings
    engine.create_adapter("fresh", LoraSpec(rank=4, seed=0))  # B = 0: the base
    rng = np.random.default_rng(3)
    seq = rng.integers(0, engine.vocab_size, 1501)
    datum = TrainDatum(seq[:-1], {"target_tokens": seq[1:], "weights": np.ones(1500, np.float32)})
    (res,) = engine.forward_backward([TrainBatch("fresh", [datum])])
    with torch.no_grad():
        logits = plain_model(input_ids=torch.as_tensor(seq[:-1])[None]).logits[0]  # (T, V)
        want = logits.float().log_softmax(-1).gather(-1, torch.as_tensor(seq[1:])[:, None])[:, 0]
    np.testing.assert_allclose(res.outputs[0]["logprobs"], want.numpy(), rtol=1e-4, atol=2e-4)
    assert all(p.grad is not None for p in engine.bank.live("fresh").parameters()[1::2])


def test_an_unknown_logit_transform_is_refused(model_dir):
    """A config that says its logits are softcapped while the forward does not cap them:
    the chunked path would disagree with the model, so check_head refuses it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval().requires_grad_(False)
    logprobs.check_head(model)
    model.config.final_logit_softcapping = 0.5
    with pytest.raises(ValueError, match="differ from the model's own"):
        logprobs.check_head(model)
