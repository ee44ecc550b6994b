"""The vLLM sampler's contract, on a real vLLM process (CPU, fp32) and Treadle's engine:

- its logprobs are the trainer's (≤ 1e-5) for one adapter and for batches mixing adapters;
- a base-model row beside adapter rows gets the base model's logprobs (the zero adapter);
- a snapshot replaced after a long prompt was cached samples with the new weights;
- the parity gate trips on a planted mismatch, and the request samples on Treadle instead,
  without failing;
- a crash of the vLLM process fails no request (they sample on Treadle).

The reference is Treadle's engine scoring the sampled tokens (prompt logprobs of prompt +
completion), which tests/engine holds to plain transformers.

    .venv/bin/python -m pytest -q tests/worker/vllm   (skips without .venv-vllm)
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from treadle.engine.types import LoraSpec, SampleRequest, SampleSpec
from treadle.protocol.ops import Op, OpKind, Outcome, Sample
from treadle.worker.executor import OpExecutor

PARITY = 1e-5
_ids = itertools.count()


def _perturb(engine, adapter_id: str, seed: int, std: float = 0.1) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pair in engine.bank.get(adapter_id).layers.values():
            pair.B.copy_(torch.randn(pair.B.shape, generator=gen) * std)


def _snapshot(executor: OpExecutor, seed: int, rank: int = 8, model: str | None = None) -> str:
    """A training model with random weights, and a sampler snapshot of it (kept: pushed)."""
    engine = executor.engine
    model = model or f"m{next(_ids)}"
    if model not in engine.bank.adapters:
        engine.create_adapter(model, LoraSpec(rank=rank, alpha=2.0 * rank))
    _perturb(engine, model, seed)
    snap = f"snap:{model}-{next(_ids)}"
    engine.snapshot(model, snap)
    executor.keep_snapshot(model, snap)
    return snap


def _op(prompt, adapter=None, n=1, max_tokens=12, seed=None, temperature=1.0) -> Op:
    spec = SampleSpec(max_tokens=max_tokens, temperature=temperature, seed=seed)
    req = SampleRequest(list(prompt), num_samples=n, params=spec, adapter=adapter)
    return Op(f"r{next(_ids)}", OpKind.SAMPLE, Sample(req))


def _run(executor: OpExecutor, ops: list[Op]) -> dict[str, Outcome]:
    out = {o.request_id: o for o in executor.admit_samples(ops)}
    while executor.sampling:
        out.update({o.request_id: o for o in executor.decode(lambda: False)})
    return out


def _trainer_logprobs(engine, prompt, tokens, adapter) -> list[float]:
    req = SampleRequest(
        list(prompt) + list(tokens), params=SampleSpec(max_tokens=0), adapter=adapter,
        prompt_logprobs=True,
    )  # fmt: skip
    return [float(x) for x in engine.sample([req])[0].prompt_logprobs[len(prompt) :]]


def _max_gap(engine, op: Op, outcome: Outcome) -> float:
    assert outcome.error is None, outcome.error
    req = op.payload.request
    gaps = [0.0]
    for seq in outcome.result.sequences:
        assert len(seq.tokens) == len(seq.logprobs) > 0
        ref = _trainer_logprobs(engine, req.prompt, seq.tokens, req.adapter)
        gaps += [abs(a - b) for a, b in zip(seq.logprobs, ref, strict=True)]
    return max(gaps)


@pytest.fixture(scope="module")
def executor(engine, vllm_sampler):
    return OpExecutor(engine, writer=None, vllm=vllm_sampler)


def _prompt(seed: int, n: int = 24) -> list[int]:
    return np.random.default_rng(seed).integers(3, 400, n).tolist()


def test_parity_single_adapter(executor, vllm_sampler):
    snap = _snapshot(executor, seed=1)
    routed = vllm_sampler.routed
    ops = [_op(_prompt(1), snap, n=3, seed=7), _op(_prompt(2), snap, max_tokens=20)]
    out = _run(executor, ops)
    assert vllm_sampler.routed == routed + 2  # vLLM sampled them, not Treadle
    assert vllm_sampler.fell_back == 0
    for op in ops:
        assert _max_gap(executor.engine, op, out[op.request_id]) <= PARITY
    # seeds: sample j is seeded seed + j, so the three differ
    seqs = [tuple(s.tokens) for s in out[ops[0].request_id].result.sequences]
    assert len(set(seqs)) == 3


def test_parity_mixed_adapters_and_base_row(executor, vllm_sampler):
    """Three snapshots of different ranks and base-model rows in one vLLM batch: each row's
    logprobs are its own weights' (a base row's, the base model's)."""
    snaps = [_snapshot(executor, seed=s, rank=r) for s, r in [(2, 4), (3, 8), (4, 16)]]
    ops = [
        _op(_prompt(10 + i), adapter, n=2, seed=i)
        for i, adapter in enumerate([None, snaps[0], None, snaps[1], snaps[2], snaps[0]])
    ]
    routed = vllm_sampler.routed
    out = _run(executor, ops)
    assert vllm_sampler.routed == routed + len(ops)
    assert vllm_sampler.fell_back == 0
    for op in ops:
        assert _max_gap(executor.engine, op, out[op.request_id]) <= PARITY, (
            op.payload.request.adapter
        )
    # and the base rows really are the base model, not an adapter
    base = out[ops[0].request_id].result.sequences[0]
    other = _trainer_logprobs(executor.engine, _prompt(10), base.tokens, snaps[1])
    assert max(abs(a - b) for a, b in zip(base.logprobs, other, strict=True)) > 1e-2


def test_what_stays_on_treadle(executor, vllm_sampler):
    """Scoring and prompt logprobs stay on Treadle's engine; a live session's weights go to
    vLLM only as a pin (a frozen copy), never under the session's own id."""
    snap = _snapshot(executor, seed=13)
    model = snap.split(":")[1].rsplit("-", 1)[0]
    score = _op(_prompt(50), snap, max_tokens=0)
    score.payload.request.prompt_logprobs = True
    with_prompt_lp = _op(_prompt(51), snap)
    with_prompt_lp.payload.request.prompt_logprobs = True
    routed = vllm_sampler.routed
    out = _run(executor, [score, with_prompt_lp])
    assert vllm_sampler.routed == routed
    assert all(o.error is None for o in out.values())
    live = _op(_prompt(52), model, seed=1)  # the training model itself: pinned, then vLLM
    out = _run(executor, [live])
    assert vllm_sampler.routed == routed + 1
    assert model not in vllm_sampler.loras
    assert _max_gap(executor.engine, live, out[live.request_id]) <= PARITY


def test_a_lora_vllm_cannot_load_samples_on_treadle(executor, vllm_sampler):
    """A rank above the process's max_lora_rank (16 here): vLLM refuses the LoRA, the
    snapshot samples on Treadle, no request fails."""
    snap = _snapshot(executor, seed=14, rank=32)
    assert snap in vllm_sampler.unsupported and snap not in vllm_sampler.loras
    routed = vllm_sampler.routed
    op = _op(_prompt(53), snap, n=2, seed=2)
    out = _run(executor, [op])
    assert vllm_sampler.routed == routed
    assert _max_gap(executor.engine, op, out[op.request_id]) <= PARITY


def test_replaced_snapshot_after_long_prompt_gets_new_weights(executor, vllm_sampler):
    """A long prompt cached in vLLM's prefix cache with one snapshot; the model trains on and
    its next snapshot samples the same prompt: the logprobs are the new weights'."""
    model = f"m{next(_ids)}"
    long_prompt = _prompt(99, n=600)
    old = _snapshot(executor, seed=5, model=model)
    first = _op(long_prompt, old, max_tokens=8, temperature=0.0)
    out = _run(executor, [first])
    assert _max_gap(executor.engine, first, out[first.request_id]) <= PARITY
    executor.drop_ref(old)  # the old snapshot goes (its LoRA with it)
    new = _snapshot(executor, seed=6, model=model)
    again = _op(long_prompt, new, max_tokens=8, temperature=0.0)
    out = _run(executor, [again])
    assert vllm_sampler.fell_back == 0
    assert _max_gap(executor.engine, again, out[again.request_id]) <= PARITY
    assert old not in vllm_sampler.loras


def test_gate_trips_on_planted_mismatch_and_falls_back(executor, vllm_sampler):
    """vLLM made to serve another adapter's weights under a snapshot's LoRA id: the gate's
    first check of that snapshot trips, the request samples on Treadle (no failure, the
    trainer's logprobs), and later requests of it go to Treadle from the start."""
    good = _snapshot(executor, seed=8)
    wrong = _snapshot(executor, seed=9)
    lora_id, _ = vllm_sampler.loras[good]
    _, wrong_folder = vllm_sampler.loras[wrong]
    vllm_sampler.process.call({"op": "remove_lora", "id": lora_id})
    vllm_sampler.process.call(
        {"op": "add_lora", "name": f"{good}@{lora_id}", "id": lora_id, "path": str(wrong_folder)}
    )
    fell_back = vllm_sampler.fell_back
    op = _op(_prompt(20), good, n=2, seed=3)
    out = _run(executor, [op])
    assert out[op.request_id].error is None
    assert vllm_sampler.fell_back == fell_back + 1
    verdict = vllm_sampler.gate.tripped[good]
    assert not verdict.passed and verdict.max_abs > 1e-2
    assert _max_gap(executor.engine, op, out[op.request_id]) <= PARITY  # Treadle's own
    routed = vllm_sampler.routed
    later = _op(_prompt(21), good)
    out = _run(executor, [later])
    assert out[later.request_id].error is None and vllm_sampler.routed == routed
    # the other snapshot still samples on vLLM
    other = _op(_prompt(22), wrong)
    _run(executor, [other])
    assert vllm_sampler.routed == routed + 1


def test_streamed_tokens_are_the_result(executor, vllm_sampler):
    """A streamed request on vLLM: its tokens come out as Progress, positions in order, and
    add up to the sequences of its result."""
    snap = _snapshot(executor, seed=12)
    op = _op(_prompt(40), snap, n=2, max_tokens=16, seed=4)
    op.payload.stream = True
    routed = vllm_sampler.routed
    heard: dict[int, list[tuple[int, int, float]]] = {0: [], 1: []}

    def on_progress(items):
        for item in items:
            for j, pos, tok, lp in item.tokens:
                heard[j].append((pos, tok, lp))

    out = {o.request_id: o for o in executor.admit_samples([op])}
    while executor.sampling:
        out.update({o.request_id: o for o in executor.decode(lambda: False, on_progress)})
    assert vllm_sampler.routed == routed + 1
    for j, seq in enumerate(out[op.request_id].result.sequences):
        assert [p for p, _, _ in heard[j]] == list(range(len(seq.tokens)))
        assert [t for _, t, _ in heard[j]] == seq.tokens
        assert [lp for _, _, lp in heard[j]] == seq.logprobs
    assert _max_gap(executor.engine, op, out[op.request_id]) <= PARITY
    assert vllm_sampler.gate.last[snap].passed  # checked after it streamed


def test_prefix_scopes_salt_the_cache(executor, vllm_sampler):
    """The same long prompt on the same weights from two prefix scopes (tenants), one after
    the other: a scope's second request hits vLLM's prefix cache, the other scope's first
    does not (its own cache salt); all with the trainer's logprobs."""
    prompt = _prompt(70, n=300)

    def cached_by(scope: str) -> int:
        op = _op(prompt, None, seed=1)
        op.payload.request.prefix_scope = scope
        before, routed = vllm_sampler.cached_tokens, vllm_sampler.routed
        out = _run(executor, [op])
        assert vllm_sampler.routed == routed + 1
        assert _max_gap(executor.engine, op, out[op.request_id]) <= PARITY
        return vllm_sampler.cached_tokens - before

    assert cached_by("tenant-a") == 0
    assert cached_by("tenant-a") >= 128  # whole blocks of the prompt
    assert cached_by("tenant-b") == 0


def test_a_cancelled_request_leaves_vllm(executor, vllm_sampler):
    """cancel_samples between two decode calls: the request leaves vLLM (aborted there) and
    the batch, metered for what it sampled; the one beside it finishes."""
    snap = _snapshot(executor, seed=15)
    long, short = _op(_prompt(60), snap, max_tokens=900), _op(_prompt(61), snap, max_tokens=8)
    out = {o.request_id: o for o in executor.admit_samples([long, short])}
    while short.request_id not in out:
        out.update({o.request_id: o for o in executor.decode(lambda: False)})
    assert executor.sampling == 1
    cancelled = executor.cancel_samples({long.request_id}, RuntimeError("cancelled"))
    assert [o.request_id for o in cancelled] == [long.request_id]
    assert executor.sampling == 0 and not executor._batch._by_rid
    assert out[short.request_id].error is None


def test_crash_of_vllm_fails_no_request(executor, vllm_sampler):
    """The vLLM process killed with requests in flight: they sample on Treadle, none fails."""
    snap = _snapshot(executor, seed=11)
    ops = [_op(_prompt(30 + i), snap, max_tokens=400, seed=i) for i in range(3)]
    fell_back = vllm_sampler.fell_back
    out = {o.request_id: o for o in executor.admit_samples(ops)}
    assert vllm_sampler.routed and executor.sampling == 3
    vllm_sampler.process.proc.kill()
    while executor.sampling:
        out.update({o.request_id: o for o in executor.decode(lambda: False)})
    assert all(out[op.request_id].error is None for op in ops)
    assert vllm_sampler.fell_back == fell_back + 3
    assert vllm_sampler.deaths == 1 and vllm_sampler.process is None
    for op in ops:
        assert _max_gap(executor.engine, op, out[op.request_id]) <= PARITY
