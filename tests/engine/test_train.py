"""forward_backward across sessions in one pass, gradient accumulation, AdamW, SFT."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from treadle.engine import Engine
from treadle.engine.types import (
    AdamSpec,
    LoraSpec,
    SampleRequest,
    SampleSpec,
    TrainBatch,
    TrainDatum,
)
from treadle.errors import InvalidRequestError, NotFoundError


def _grads(engine, aid: str) -> list[torch.Tensor]:
    return [p.grad.clone() for p in engine.bank.live(aid).parameters()]


def _clear(engine, aid: str) -> None:
    for p in engine.bank.live(aid).parameters():
        p.grad = None


def _close(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    """Equal to fp32 rounding. The same sums in another order (another kernel, another batch
    layout) differ by a few ulps of a tensor's largest entries, so atol grows with them:
    gradients of up to 19 here differ by up to 3e-5 on some CPUs."""
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5 * max(1.0, y.abs().max().item()))


@pytest.mark.parametrize("top_k", [False, True])  # one logprob pass for all, or split logits
def test_mixed_batch_equals_separate_passes(engine, sft_datum, new_id, top_k):
    specs = [
        LoraSpec(rank=2, alpha=4, seed=1),
        LoraSpec(rank=8, alpha=8, seed=2, train_mlp=False),
        LoraSpec(rank=4, alpha=16, seed=3, train_unembed=False),
    ]
    ids = [new_id() for _ in specs]
    data = {}
    for k, (aid, spec) in enumerate(zip(ids, specs, strict=True)):
        engine.create_adapter(aid, spec)
        k_targets = 3 if top_k and k == 2 else 0  # the last batch: 3 targets per position
        data[aid] = [sft_datum(T, 10 * k + j, k_targets) for j, T in enumerate((5, 11, 8))]
        # one step first: B != 0, so every parameter gets a gradient below
        engine.forward_backward([TrainBatch(aid, data[aid])])
        engine.optim_step(aid, AdamSpec(learning_rate=1e-2))
    batches = [TrainBatch(aid, data[aid]) for aid in ids]
    batches[1].loss_fn, batches[1].data = (
        "importance_sampling",
        [
            TrainDatum(
                d.tokens,
                {
                    "target_tokens": d.loss_inputs["target_tokens"],
                    "logprobs": -np.ones(len(d.tokens), np.float32),
                    "advantages": np.linspace(-1, 1, len(d.tokens)).astype(np.float32),
                },
            )
            for d in data[ids[1]]
        ],
    )
    mixed = engine.forward_backward(batches)
    mixed_grads = {aid: _grads(engine, aid) for aid in ids}
    for aid, batch, result in zip(ids, batches, mixed, strict=True):
        _clear(engine, aid)
        (alone,) = engine.forward_backward([batch])
        assert result.metrics["loss:sum"] == pytest.approx(alone.metrics["loss:sum"], rel=1e-5)
        for x, y in zip(result.outputs, alone.outputs, strict=True):
            np.testing.assert_allclose(x["logprobs"], y["logprobs"], rtol=1e-5, atol=1e-5)
        _close(mixed_grads[aid], _grads(engine, aid))
        assert all(g.abs().max() > 0 for g in mixed_grads[aid])
        engine.drop_adapter(aid)


@pytest.mark.parametrize("lengths", [(6, 9, 5, 4), (3, 5, 2, 4)])  # long rows, decode-short rows
def test_same_adapter_in_two_batches_of_one_call(engine, helpers, sft_datum, new_id, lengths):
    """Rows of one adapter scattered in the batch (a, b, c, a): each gets its own gradient."""
    ids = [new_id() for _ in range(3)]
    for k, aid in enumerate(ids):
        engine.create_adapter(aid, LoraSpec(rank=2 + 2 * k, seed=k))
        helpers.perturb(engine.bank.live(aid), seed=k)
    a, b, c = ids
    data = [sft_datum(T, seed=k) for k, T in enumerate(lengths)]
    keys = [a, b, c, a]
    res = engine.forward_backward([TrainBatch(k, [d]) for k, d in zip(keys, data, strict=True)])
    mixed_grads = {aid: _grads(engine, aid) for aid in ids}
    for aid in ids:
        _clear(engine, aid)
    (ra,) = engine.forward_backward([TrainBatch(a, [data[0], data[3]])])
    (rb,) = engine.forward_backward([TrainBatch(b, [data[1]])])
    (rc,) = engine.forward_backward([TrainBatch(c, [data[2]])])
    for aid in ids:
        _close(mixed_grads[aid], _grads(engine, aid))
    assert res[0].metrics["loss:sum"] + res[3].metrics["loss:sum"] == pytest.approx(
        ra.metrics["loss:sum"], rel=1e-5
    )
    alone = [ra.outputs[0], rb.outputs[0], rc.outputs[0], ra.outputs[1]]
    for r, expected in zip(res, alone, strict=True):
        np.testing.assert_allclose(
            r.outputs[0]["logprobs"], expected["logprobs"], rtol=1e-5, atol=1e-5
        )
    for aid in ids:
        engine.drop_adapter(aid)


def test_padding_changes_nothing(engine, helpers, plain_model, sft_datum, new_id):
    aid = new_id()
    engine.create_adapter(aid, LoraSpec(rank=4, seed=9))
    helpers.perturb(engine.bank.live(aid), seed=9)
    short, long = sft_datum(4, seed=1), sft_datum(13, seed=2)
    (alone,) = engine.forward_backward([TrainBatch(aid, [short])])
    g_alone = _grads(engine, aid)
    _clear(engine, aid)
    engine.forward_backward([TrainBatch(aid, [long])])
    g_long = _grads(engine, aid)
    _clear(engine, aid)
    (both,) = engine.forward_backward([TrainBatch(aid, [short, long])])
    np.testing.assert_allclose(
        both.outputs[0]["logprobs"], alone.outputs[0]["logprobs"], rtol=1e-5, atol=1e-5
    )
    # gradients of one pass over both datums = sum of the two single passes
    _close(_grads(engine, aid), [a + b for a, b in zip(g_alone, g_long, strict=True)])
    engine.drop_adapter(aid)


def test_gradients_accumulate_until_step(engine, sft_datum, new_id):
    aid = new_id()
    engine.create_adapter(aid, LoraSpec(rank=4, seed=3))
    d = [sft_datum(7, seed=4)]
    engine.forward_backward([TrainBatch(aid, d)])
    once = _grads(engine, aid)
    engine.forward_backward([TrainBatch(aid, d)])
    _close(_grads(engine, aid), [2 * g for g in once])
    engine.optim_step(aid, AdamSpec(learning_rate=1e-3))
    assert all(p.grad is None for p in engine.bank.live(aid).parameters())
    engine.forward_backward([TrainBatch(aid, d)], forward_only=True)
    assert all(p.grad is None for p in engine.bank.live(aid).parameters())
    assert engine.adapter_step(aid) == 1
    engine.drop_adapter(aid)


@pytest.mark.parametrize("clip, wd", [(0.0, 0.0), (0.05, 0.1), (1e6, 0.01)])
def test_adamw_equals_torch(engine, sft_datum, new_id, clip, wd):
    aid = new_id()
    engine.create_adapter(aid, LoraSpec(rank=4, seed=5))
    params = engine.bank.live(aid).parameters()
    copies = [p.detach().clone().requires_grad_(True) for p in params]
    specs = [
        AdamSpec(
            learning_rate=1e-2,
            beta1=0.9,
            beta2=0.95,
            eps=1e-8,
            weight_decay=wd,
            grad_clip_norm=clip,
        ),
        AdamSpec(
            learning_rate=5e-3,
            beta1=0.8,
            beta2=0.99,
            eps=1e-12,
            weight_decay=wd,
            grad_clip_norm=clip,
        ),
        AdamSpec(
            learning_rate=2e-3,
            beta1=0.8,
            beta2=0.99,
            eps=1e-12,
            weight_decay=wd,
            grad_clip_norm=clip,
        ),
    ]
    reference = torch.optim.AdamW(copies, lr=1.0)
    for step, spec in enumerate(specs):
        engine.forward_backward([TrainBatch(aid, [sft_datum(9, seed=step)])])
        for c, p in zip(copies, params, strict=True):
            c.grad = p.grad.clone()
        norm = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(c.grad) for c in copies])
        )
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(copies, clip)
        for group in reference.param_groups:
            group.update(
                lr=spec.learning_rate,
                betas=(spec.beta1, spec.beta2),
                eps=spec.eps,
                weight_decay=spec.weight_decay,
            )
        reference.step()
        metrics = engine.optim_step(aid, spec)
        assert metrics["grad_norm:mean"] == pytest.approx(float(norm), rel=1e-5)
        assert metrics["learning_rate:mean"] == spec.learning_rate
        for c, p in zip(copies, params, strict=True):
            assert torch.equal(c.detach(), p.detach())
        assert all(key.count(":") == 1 for key in metrics)  # the protocol's name:reduction
    engine.drop_adapter(aid)


def test_sft_drives_loss_to_zero(engine, new_id):
    aid = new_id()
    engine.create_adapter(aid, LoraSpec(rank=16, alpha=16, seed=0))
    texts = [
        "Max has 3 apples. He finds 2 more. Answer: 5",
        "Ana has 7 pens. She loses 4. Answer: 3",
        "Hello! How can I help you today?",
        "The sky is usually blue during the day.",
    ]
    data = []
    for text in texts:
        seq = np.asarray(engine.tokenizer(text)["input_ids"])
        w = np.ones(len(seq) - 1, np.float32)
        data.append(TrainDatum(seq[:-1], {"target_tokens": seq[1:], "weights": w}))
    n_tokens = sum(len(d.tokens) for d in data)
    losses = []
    for _ in range(60):
        (res,) = engine.forward_backward([TrainBatch(aid, data)])
        engine.optim_step(aid, AdamSpec(learning_rate=5e-3, beta2=0.99))
        losses.append(res.metrics["loss:sum"] / n_tokens)
    assert losses[0] > 4.0  # about log(vocab): the random base knows nothing
    assert losses[-1] < 0.05, losses[::10]
    engine.drop_adapter(aid)


def test_bfloat16_base_keeps_fp32_loss(model_dir, new_id, sft_datum):
    from transformers import AutoModelForCausalLM

    eng = Engine(model_dir, dtype="bfloat16")
    aid = new_id()
    eng.create_adapter(aid, LoraSpec(rank=4))
    d = sft_datum(9, seed=1)
    (res,) = eng.forward_backward([TrainBatch(aid, [d])])
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    with torch.no_grad():
        logits = ref(input_ids=torch.as_tensor(d.tokens)[None]).logits[0]  # (T, V) bf16
    lp = (
        logits.float()
        .log_softmax(-1)
        .gather(-1, torch.as_tensor(d.loss_inputs["target_tokens"])[:, None])[:, 0]
    )
    np.testing.assert_allclose(res.outputs[0]["logprobs"], lp.numpy(), rtol=1e-5, atol=1e-5)
    assert all(
        p.grad is not None and p.grad.dtype == torch.float32
        for p in eng.bank.live(aid).parameters()
    )
    eng.optim_step(aid, AdamSpec(learning_rate=1e-3))


def test_optim_step_errors(engine, new_id):
    aid = new_id()
    engine.create_adapter(aid, LoraSpec(rank=2))
    with pytest.raises(
        InvalidRequestError, match=r"adam_params.beta2 must be in \[0, 1\), got 1.0"
    ):
        engine.optim_step(aid, AdamSpec(beta2=1.0))
    with pytest.raises(InvalidRequestError, match="adam_params.learning_rate must be >= 0, got -1"):
        engine.optim_step(aid, AdamSpec(learning_rate=-1))
    with pytest.raises(InvalidRequestError, match="grad_clip_norm"):
        engine.optim_step(aid, AdamSpec(grad_clip_norm=float("nan")))
    snap = new_id("snap")
    engine.snapshot(aid, snap)
    with pytest.raises(NotFoundError, match=snap):
        engine.optim_step(snap, AdamSpec())
    engine.drop_snapshot(snap)
    engine.drop_adapter(aid)


def test_small_calls_run_on_one_thread_and_the_setting_comes_back(engine, sft_datum, new_id):
    """A forward of a few tokens, a prefill of a short prompt and a decode step of a few rows
    run on one intra-op thread (treadle.engine.threads); larger ones on all of them."""
    aid = new_id()
    engine.create_adapter(aid, LoraSpec(rank=4))
    seen: list[tuple[int, int]] = []  # (tokens fed, threads) per model call
    hook = engine.model.register_forward_hook(
        lambda m, args, kw, out: seen.append((kw["input_ids"].numel(), torch.get_num_threads())),
        with_kwargs=True,
    )
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for T in (1, 4, 16):
            engine.forward_backward([TrainBatch(aid, [sft_datum(T, seed=T)])], forward_only=True)
        engine.forward_backward([TrainBatch(aid, [sft_datum(2, seed=0)])])
        assert torch.get_num_threads() == 2  # back after each call
        assert seen == [(1, 1), (4, 1), (16, 2), (2, 1)]
        seen.clear()
        spec = SampleSpec(max_tokens=3, seed=0, stop_at_eos=False)
        engine.sample([SampleRequest([1, 2], num_samples=2, params=spec, adapter=aid)])
        engine.sample([SampleRequest([1, 2, 3, 4, 5, 6], num_samples=8, params=spec)])
        assert torch.get_num_threads() == 2
        # prefill of the 2-token prompt, 2 decode steps of 2 rows; then 6 tokens, 8 rows
        assert seen == [(2, 1), (2, 1), (2, 1), (6, 2), (8, 2), (8, 2)]
    finally:
        hook.remove()
        torch.set_num_threads(before)
        engine.drop_adapter(aid)
