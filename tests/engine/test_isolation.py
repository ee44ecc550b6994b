"""Containment: a tenant that drives its own adapter to NaN or inf cannot touch the numbers of
the rows it shares a batch with (other adapters, snapshots, the base), a non-finite
forward_backward or optim_step changes nothing, and nothing non-finite or oversized gets in.

Each check runs the poisoned batch twice more: with the poisoned adapter swapped for a healthy
one of the same shapes (identical arithmetic for every other row: compared exactly) and every
request alone (other batch shapes: compared to 1e-5).

    .venv/bin/python -m pytest -q tests/engine/test_isolation.py
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from treadle.engine import Engine
from treadle.engine.lora import unsafe_layer
from treadle.engine.train import NONFINITE
from treadle.engine.types import AdamSpec, LoraSpec, SampleRequest, SampleSpec, TrainBatch
from treadle.errors import InvalidRequestError

POISONS = ["nan_B", "inf_A", "huge"]


def _sharpen(model: torch.nn.Module) -> None:
    """Confident yet varied random weights (HF's init repeats one token: greedy would prove
    little)."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2 and "embed" not in name:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
        emb = model.get_input_embeddings().weight
        emb.copy_(torch.randn(emb.shape, generator=gen) * 0.1)


@pytest.fixture(scope="module")
def eng(model_dir):
    """An engine of its own: adapters here get poisoned in place."""
    engine = Engine(model_dir)
    _sharpen(engine.model)
    return engine


def _adapter(eng, aid: str, seed: int, **spec) -> None:
    """A trained-looking adapter: random B, so it really changes the output."""
    eng.create_adapter(aid, LoraSpec(seed=seed, **spec))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pair in eng.bank.live(aid).layers.values():
            pair.B.copy_(torch.randn(pair.B.shape, generator=gen) * 0.05)


def _poison(eng, aid: str, how: str) -> None:
    with torch.no_grad():
        for pair in eng.bank.get(aid).layers.values():
            if how == "nan_B":
                pair.B[0, 0] = float("nan")
            elif how == "inf_A":
                pair.A[0, 0] = float("inf")
            else:  # finite weights whose product overflows: what learning_rate 1e30 left
                pair.A.fill_(1e30)
                pair.B.fill_(1e30)


@pytest.fixture
def tenants(eng, new_id):
    """good (rank 4), other (rank 8, attention only), bad (rank 4, poisoned by the test) and
    healthy: bad's twin, the same shapes, never poisoned."""
    ids = {name: new_id(name) for name in ("good", "other", "bad", "healthy")}
    _adapter(eng, ids["good"], seed=1, rank=4)
    _adapter(eng, ids["other"], seed=2, rank=8, train_mlp=False, train_unembed=False)
    _adapter(eng, ids["bad"], seed=3, rank=4)
    _adapter(eng, ids["healthy"], seed=3, rank=4)
    yield ids
    for aid in ids.values():
        eng.drop_adapter(aid)


def _ids(eng, B: int, T: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, eng.vocab_size, (B, T), generator=gen)  # (B, T)


@torch.no_grad()
def _logits(eng, keys: list, ids: torch.Tensor) -> torch.Tensor:
    with eng.bank.rows(keys):
        return eng.model(input_ids=ids).logits  # (B, T, V)


# ---- forward: every LoRA path ----
LAYOUTS = {
    "scattered": ["good", "bad", None, "other", "bad", "good", None],
    "one_each": ["good", "bad", "other"],
    "pairs": ["good", "good", "bad", "bad", "other", "other"],
}


@pytest.mark.parametrize("how", POISONS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("T", [1, 5, 20])  # a decode step (grouped), prefills (segments)
def test_poisoned_adapter_leaves_its_batch_alone(eng, tenants, how, layout, T):
    bad, healthy = tenants["bad"], tenants["healthy"]
    keys = [tenants[k] if k else None for k in LAYOUTS[layout]]
    ids = _ids(eng, len(keys), T)
    _poison(eng, bad, how)
    mixed = _logits(eng, keys, ids)
    assert not torch.isfinite(mixed[keys.index(bad)]).all()  # the poison works
    twin = _logits(eng, [healthy if k == bad else k for k in keys], ids)
    base = _logits(eng, [None] * len(keys), ids)
    for row, key in enumerate(keys):
        if key == bad:
            continue
        assert torch.equal(mixed[row], twin[row]), (row, key)
        if key is None:  # the exact base output, not merely close to it
            assert torch.equal(mixed[row], base[row])
            continue
        alone = _logits(eng, [key] * len(keys), ids)
        # alone may take the merged weight (another summation order): fp32 rounding only
        torch.testing.assert_close(mixed[row], alone[row], rtol=1e-5, atol=3e-5)
        assert (alone[row] - base[row]).abs().max() > 1e-2  # the adapter does something


@pytest.mark.parametrize("how", POISONS)
def test_poisoned_snapshot_next_to_live_adapters(eng, tenants, new_id, how):
    """A frozen copy (what samplers read) is routed like a live adapter and contained too."""
    good, bad = tenants["good"], tenants["bad"]
    snap = new_id("snap")
    eng.snapshot(bad, snap)
    _poison(eng, snap, how)
    ids = _ids(eng, 3, 1)
    mixed = _logits(eng, [snap, good, snap], ids)
    alone = _logits(eng, [good] * 3, ids)
    torch.testing.assert_close(mixed[1], alone[1], rtol=0, atol=1e-5)
    eng.drop_snapshot(snap)


# ---- sampling: prefill, decode, prompt logprobs ----
def _requests(tenants: dict, temperature: float) -> list[SampleRequest]:
    prompts = [[5, 17, 300], [44] * 12, [1, 2, 3, 4, 5, 6, 7], [400, 12, 13, 14, 15]]
    owners = ["good", "bad", None, "other", "bad", "good", None]
    reqs = []
    for i, owner in enumerate(owners):
        spec = SampleSpec(max_tokens=9, temperature=temperature, seed=i, stop_at_eos=False)
        key = tenants[owner] if owner else None
        reqs.append(SampleRequest(prompts[i % 4], 2, spec, key, prompt_logprobs=i % 2 == 0))
    return reqs


@pytest.mark.parametrize("temperature", [0.0, 1.0])  # greedy and seeded
@pytest.mark.parametrize("how", POISONS)
def test_sampling_beside_a_poisoned_adapter(eng, tenants, temperature, how):
    reqs = _requests(tenants, temperature)
    _poison(eng, tenants["bad"], how)
    mixed = eng.sample(reqs)
    twin_reqs = [
        SampleRequest(r.prompt, r.num_samples, r.params,
                      tenants["healthy"] if r.adapter == tenants["bad"] else r.adapter,
                      prompt_logprobs=r.prompt_logprobs)
        for r in reqs
    ]  # fmt: skip
    twin = eng.sample(twin_reqs)
    for req, res, res_twin in zip(reqs, mixed, twin, strict=True):
        if req.adapter == tenants["bad"]:
            assert not np.isfinite([lp for s in res.sequences for lp in s.logprobs]).all()
            continue
        alone = eng.sample([req])[0]
        assert [s.tokens for s in res.sequences] == [s.tokens for s in res_twin.sequences]
        assert [s.logprobs for s in res.sequences] == [s.logprobs for s in res_twin.sequences]
        assert res.prompt_logprobs == res_twin.prompt_logprobs
        assert [s.tokens for s in res.sequences] == [s.tokens for s in alone.sequences]
        for a, b in zip(res.sequences, alone.sequences, strict=True):
            np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
        if req.prompt_logprobs:
            np.testing.assert_allclose(
                res.prompt_logprobs[1:], alone.prompt_logprobs[1:], rtol=0, atol=1e-5
            )


# ---- training ----
def _grads(eng, aid: str) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in eng.bank.live(aid).parameters()]


def _equal_to_rounding(x: torch.Tensor, y: torch.Tensor) -> None:
    """The same sums in another order differ by a few ulps of the tensor's largest entries
    (measured: up to 5e-7 of them), so atol grows with them past 1 (as test_train's _close);
    a dropped or leaked row differs by O(1)."""
    torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6 * max(1.0, y.abs().max().item()))


def _clear(eng, *aids: str) -> None:
    for aid in aids:
        for p in eng.bank.live(aid).parameters():
            p.grad = None


@pytest.mark.parametrize("how", POISONS)
@pytest.mark.parametrize("T", [4, 12])
def test_training_beside_a_poisoned_adapter(eng, tenants, sft_datum, how, T):
    good, other, bad, healthy = tenants.values()
    data = {k: [sft_datum(T, seed=10 + i), sft_datum(T - 1, seed=20 + i)] for i, k in
            enumerate((good, other, bad))}  # fmt: skip
    order = [good, bad, other]
    _poison(eng, bad, how)
    mixed = eng.forward_backward([TrainBatch(k, data[k]) for k in order])
    g_mixed = {k: _grads(eng, k) for k in (good, other, bad)}
    _clear(eng, good, other)
    twin = eng.forward_backward([TrainBatch(healthy if k == bad else k, data[k]) for k in order])
    g_twin = {k: _grads(eng, k) for k in (good, other)}
    assert mixed[1].metrics[NONFINITE] == 1.0
    assert all(g is None for g in g_mixed[bad])  # nothing added to the poisoned adapter
    for i, key in ((0, good), (2, other)):
        assert mixed[i].metrics == twin[i].metrics and mixed[i].metrics[NONFINITE] == 0.0
        for x, y in zip(mixed[i].outputs, twin[i].outputs, strict=True):
            assert np.array_equal(x["logprobs"], y["logprobs"])
        assert all(torch.equal(x, y) for x, y in zip(g_mixed[key], g_twin[key], strict=True))
        _clear(eng, key)
        (alone,) = eng.forward_backward([TrainBatch(key, data[key])])
        assert mixed[i].metrics["loss:sum"] == pytest.approx(alone.metrics["loss:sum"], rel=1e-6)
        for x, y in zip(mixed[i].outputs, alone.outputs, strict=True):
            np.testing.assert_allclose(x["logprobs"], y["logprobs"], rtol=0, atol=1e-5)
        for x, y in zip(g_mixed[key], _grads(eng, key), strict=True):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5 * float(y.abs().max()))
    # the poisoned batch forward only: its own rows are NaN, the others' are not
    fwd = eng.forward_backward([TrainBatch(k, data[k]) for k in order], forward_only=True)
    assert fwd[1].metrics[NONFINITE] == 1.0 and fwd[0].metrics[NONFINITE] == 0.0
    for x, y in zip(fwd[0].outputs, mixed[0].outputs, strict=True):
        np.testing.assert_allclose(x["logprobs"], y["logprobs"], rtol=0, atol=1e-5)


class _InfGrad(torch.autograd.Function):
    """The identity forward, an infinite gradient backward: a finite loss whose gradients
    are not (as a loss through overflowing activations gives)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("inf")


def test_weights_that_cannot_be_meant_are_refused_before_the_pass(eng, tenants, sft_datum):
    """weights 1e38: refused by the shared rules (treadle.engine.specs), nothing computed."""
    good = tenants["good"]
    huge = sft_datum(8, seed=2)
    huge.loss_inputs["weights"] = np.full(8, 1e38, np.float32)
    before = _grads(eng, good)
    with pytest.raises(InvalidRequestError, match=r"\['weights'\] must lie within"):
        eng.forward_backward([TrainBatch(good, [huge])])
    assert all(
        (x is None and y is None) or torch.equal(x, y)
        for x, y in zip(before, _grads(eng, good), strict=True)
    )


def test_an_infinite_loss_adds_nothing(eng, tenants, sft_datum):
    """Inputs within bounds whose loss still overflows (sampler logprobs of -1e6 make the
    importance ratio infinite): the batch is flagged and its adapter's gradients stay as
    they were; the other adapter of the call is untouched."""
    good, other = tenants["good"], tenants["other"]
    ok = [sft_datum(8, seed=1)]
    eng.forward_backward([TrainBatch(good, ok)])
    before = _grads(eng, good)
    (other_alone,) = eng.forward_backward([TrainBatch(other, ok)])
    other_before = _grads(eng, other)
    _clear(eng, other)
    ratio = sft_datum(8, seed=2)
    ratio.loss_inputs = {
        "target_tokens": ratio.loss_inputs["target_tokens"],
        "logprobs": np.full(8, -1e6, np.float32),
        "advantages": np.full(8, -1.0, np.float32),
    }
    res = eng.forward_backward(
        [TrainBatch(good, [ratio], "importance_sampling"), TrainBatch(other, ok)]
    )
    assert not np.isfinite(res[0].metrics["loss:sum"]) and res[0].metrics[NONFINITE] == 1.0
    assert res[1].metrics == other_alone.metrics
    assert all(torch.equal(x, y) for x, y in zip(before, _grads(eng, good), strict=True))
    # alone, `other` takes the single-adapter kernels (lora._LoraLinear), mixed the
    # segmented ones: the same sums in another order, equal to rounding
    for x, y in zip(other_before, _grads(eng, other), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    eng.optim_step(good, AdamSpec(learning_rate=1e-2))
    assert unsafe_layer(eng.bank.live(good).layers) is None
    assert eng.adapter_step(good) == 1


def test_two_batches_of_one_adapter_only_the_bad_one_drops(eng, tenants, sft_datum, monkeypatch):
    from treadle.engine import train

    good = tenants["good"]
    ok, loud = [sft_datum(8, seed=1)], [sft_datum(8, seed=3)]
    eng.forward_backward([TrainBatch(good, ok)])
    once = _grads(eng, good)
    real = train._batch_loss

    def batch_loss(lp, batch, *rest):
        loss, outputs = real(lp, batch, *rest)
        return (_InfGrad.apply(loss) if batch.data is loud else loss), outputs

    monkeypatch.setattr(train, "_batch_loss", batch_loss)
    res = eng.forward_backward([TrainBatch(good, ok), TrainBatch(good, loud)])
    assert np.isfinite(res[1].metrics["loss:sum"]) and res[1].metrics[NONFINITE] == 1.0
    assert res[0].metrics[NONFINITE] == 0.0
    for x, y in zip(once, _grads(eng, good), strict=True):  # sums over 8 rows, then 16
        _equal_to_rounding(2 * x, y)
    (alone,) = eng.forward_backward([TrainBatch(good, loud)])
    assert alone.metrics[NONFINITE] == 1.0


def _state(eng, aid: str) -> tuple:
    adapter = eng.bank.live(aid)
    opt = adapter.extra.get("optimizer")
    moments = [] if opt is None else [
        (k, v.clone()) for p in adapter.parameters() for k, v in opt.state[p].items()
    ]  # fmt: skip
    groups = None if opt is None else [dict(g, params=None) for g in opt.param_groups]
    return (
        [p.detach().clone() for p in adapter.parameters()],
        _grads(eng, aid),
        moments,
        groups,
        adapter.extra.get("step"),
    )


def _identical(a: tuple, b: tuple) -> bool:
    def same(x, y) -> bool:
        if isinstance(x, torch.Tensor):
            return torch.equal(x, y)
        if isinstance(x, list | tuple):
            return len(x) == len(y) and all(same(p, q) for p, q in zip(x, y, strict=True))
        return x == y

    return same(a, b)


@pytest.mark.parametrize("clip", [0.0, 1.0])
@pytest.mark.parametrize("first", [True, False])  # the adapter's first step, or a later one
def test_optim_step_with_learning_rate_1e30_changes_nothing(eng, tenants, sft_datum, clip, first):
    good = tenants["good"]
    batch = [TrainBatch(good, [sft_datum(8, seed=4)])]
    if not first:
        eng.forward_backward(batch)
        eng.optim_step(good, AdamSpec(learning_rate=1e-3))
    eng.forward_backward(batch)
    before = _state(eng, good)
    with pytest.raises(InvalidRequestError, match=r"learning_rate 1e\+30.*grad norm"):
        eng.optim_step(good, AdamSpec(learning_rate=1e30, grad_clip_norm=clip))
    assert _identical(_state(eng, good), before)
    assert ("optimizer" in eng.bank.live(good).extra) == (not first)
    # the kept gradients give a normal step at once, like the refused call never happened
    metrics = eng.optim_step(good, AdamSpec(learning_rate=1e-3, grad_clip_norm=clip))
    assert np.isfinite(metrics["grad_norm:mean"])
    assert unsafe_layer(eng.bank.live(good).layers) is None
    assert eng.adapter_step(good) == (1 if first else 2)


def test_optim_step_with_overflowing_gradients_drops_them(eng, tenants, sft_datum):
    """Finite gradients of 1e30: AdamW's squares overflow whatever the learning rate. They are
    dropped (they could never step), the rest stays, training goes on."""
    good = tenants["good"]
    eng.forward_backward([TrainBatch(good, [sft_datum(8, seed=5)])])
    eng.optim_step(good, AdamSpec(learning_rate=1e-3))
    eng.forward_backward([TrainBatch(good, [sft_datum(8, seed=6)])])
    for p in eng.bank.live(good).parameters():
        p.grad.fill_(1e30)
    weights, _, moments, groups, step = _state(eng, good)
    with pytest.raises(InvalidRequestError, match="too large for AdamW.*dropped"):
        eng.optim_step(good, AdamSpec(learning_rate=1e-3))
    after = _state(eng, good)
    assert _identical(after[0], weights) and _identical(after[2:], (moments, groups, step))
    assert all(g is None for g in after[1])
    for p in eng.bank.live(good).parameters():  # set from outside: refused, then dropped
        p.grad = torch.full_like(p, float("nan"))
    with pytest.raises(InvalidRequestError, match="not finite.*dropped"):
        eng.optim_step(good, AdamSpec(learning_rate=1e-3))
    assert _identical(_state(eng, good)[0], weights)
    eng.forward_backward([TrainBatch(good, [sft_datum(8, seed=7)])])
    eng.optim_step(good, AdamSpec(learning_rate=1e-3))
    assert eng.adapter_step(good) == 2 and unsafe_layer(eng.bank.live(good).layers) is None


# ---- what may get in ----
def test_rank_bound_is_checked_before_allocation(eng, new_id):
    # the tiny model is 128 wide: rank 128 is full rank on every layer, more adds nothing
    assert eng.max_lora_rank == 128
    assert eng.bank.max_rank(LoraSpec(train_attn=False, train_unembed=False)) == 128
    assert eng.bank.max_rank(LoraSpec(train_attn=False, train_mlp=False, train_unembed=False)) == 0
    aid = new_id()
    eng.create_adapter(aid, LoraSpec(rank=128))
    eng.drop_adapter(aid)
    for rank in (129, 2**31):  # 2**31 would ask for terabytes
        with pytest.raises(InvalidRequestError, match=f"must be <= 128.*got {rank}"):
            eng.create_adapter(new_id(), LoraSpec(rank=rank))
    lin = eng.bank.modules["model.layers.0.self_attn.q_proj"]
    wide = {"model.layers.0.self_attn.q_proj": (torch.zeros(129, lin.in_features),
                                                torch.zeros(lin.out_features, 129))}  # fmt: skip
    with pytest.raises(InvalidRequestError, match=r"rank must be in \[1, 128\].*got 129"):
        eng.bank.add(new_id(), LoraSpec(rank=129), wide, {"model.layers.0.self_attn.q_proj": 1.0})


def _saved(eng, new_id, tmp_path, sft_datum) -> str:
    aid = new_id()
    _adapter(eng, aid, seed=9, rank=4)
    eng.forward_backward([TrainBatch(aid, [sft_datum(6, seed=9)])])
    eng.optim_step(aid, AdamSpec(learning_rate=1e-3))
    eng.save_state(aid, tmp_path / "state")
    return aid


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 1e30])
def test_loading_non_finite_weights_is_refused(eng, new_id, tmp_path, sft_datum, value):
    aid = _saved(eng, new_id, tmp_path, sft_datum)
    weights_file = tmp_path / "state" / "adapter_model.safetensors"
    tensors = load_file(str(weights_file))
    key = sorted(k for k in tensors if "lora_A" in k)[3]
    tensors[key] = tensors[key].fill_(value) if value == 1e30 else tensors[key]
    tensors[key][0, 0] = value
    if value == 1e30:  # finite A and B whose update overflows
        partner = key.replace("lora_A", "lora_B")
        tensors[partner] = torch.full_like(tensors[partner], 1e30)
    save_file(tensors, str(weights_file), metadata={"format": "pt"})
    before = _state(eng, aid)
    with pytest.raises(InvalidRequestError, match="not finite"):
        eng.load_adapter(new_id(), tmp_path / "state")
    with pytest.raises(InvalidRequestError, match="not finite"):
        eng.load_state(aid, tmp_path / "state")  # replacing: the old one stays
    assert _identical(_state(eng, aid), before)
    eng.drop_adapter(aid)


def test_loading_non_finite_optimizer_state_is_refused(eng, new_id, tmp_path, sft_datum):
    aid = _saved(eng, new_id, tmp_path, sft_datum)
    opt_file = tmp_path / "state" / "optimizer.pt"
    state = torch.load(opt_file, weights_only=True)
    state["state"][5]["exp_avg_sq"][0, 0] = float("inf")
    torch.save(state, opt_file)
    before = _state(eng, aid)
    with pytest.raises(InvalidRequestError, match="exp_avg_sq.*not finite"):
        eng.load_state(aid, tmp_path / "state")
    assert _identical(_state(eng, aid), before)
    fresh = new_id()  # weights only: the optimizer file is not read
    eng.load_state(fresh, tmp_path / "state", with_optimizer=False)
    meta = json.loads((tmp_path / "state" / "treadle_state.json").read_text())
    assert meta["step"] == 1 and eng.adapter_step(fresh) == 0
    for x in (aid, fresh):
        eng.drop_adapter(x)
