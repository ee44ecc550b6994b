"""The scenario every group test runs: the same engine calls on one process and on a group.

`run(engine, model_dir)` drives any object with the Engine's methods (an Engine, or rank 0's
DistributedEngine) and returns what the tests compare: per call the logprobs and losses,
the accumulated gradients after the first forward_backward, the adapters after 5
optim_steps, seeded samples, and a decode batch driven as the worker drives it (`decode`:
requests of mixed adapters, a yield after a few steps, requests joining mid-generation,
streamed tokens). Every rank logs its model calls (`ModelCalls`), so that the test can
count each rank's decode steps. `rank_main` is the body of one spawned rank.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from treadle.engine.types import (
    AdamSpec,
    Constraint,
    LoraSpec,
    SampleRequest,
    SampleSpec,
    TrainBatch,
    TrainDatum,
)

SESSIONS = ("s0", "s1", "s2")
STEPS = 5
YIELD_AFTER = 3  # decode steps before the decode batch yields
START, END = 19, 17  # lengths of the marker calls around those steps


class ModelCalls:
    """Every model call of this process: "d" a decode step (one token per row, with a KV
    cache), "t<T>" a training-side call of T positions, "-" anything else."""

    def __init__(self, model: Any):
        self.log: list[str] = []
        model.register_forward_pre_hook(self._call, with_kwargs=True)

    def _call(self, module: Any, args: Any, kwargs: dict) -> None:
        ids = kwargs.get("input_ids")
        cache = kwargs.get("past_key_values", kwargs.get("cache"))
        if not torch.is_inference_mode_enabled():
            self.log.append(f"t{ids.shape[1]}")
        elif cache is not None and ids.shape[1] == 1:
            self.log.append("d")
        else:
            self.log.append("-")

    def between_markers(self) -> list[str]:
        """The decode steps between the START and END marker calls."""
        start = self.log.index(f"t{START}")
        return [c for c in self.log[start : self.log.index(f"t{END}", start)] if c == "d"]


def _datum(rng: np.random.Generator, T: int, rl: bool = False) -> TrainDatum:
    seq = rng.integers(1, 400, T + 1)
    inputs: dict[str, np.ndarray] = {"target_tokens": seq[1:].astype(np.int64)}
    if rl:
        inputs["logprobs"] = rng.uniform(-8, -5, T).astype(np.float32)
        inputs["advantages"] = rng.normal(size=T).astype(np.float32)
    else:
        inputs["weights"] = rng.uniform(0, 1, T).astype(np.float32)
    return TrainDatum(seq[:-1].astype(np.int64), inputs)


def _overflow(seed: int) -> TrainDatum:
    """Sampler logprobs of -1e6: the importance ratio, and so the loss, is infinite."""
    d = _datum(np.random.default_rng(seed), 8, rl=True)
    d.loss_inputs["logprobs"] = np.full(8, -1e6, np.float32)
    d.loss_inputs["advantages"] = np.full(8, -1.0, np.float32)
    return d


def mixed_batch(step: int) -> list[TrainBatch]:
    """Three sessions in one call: uneven rows and lengths, two losses, and two batches of
    one session (chunks of one request), so that sessions are cut between ranks."""
    rng = np.random.default_rng(step)
    return [
        TrainBatch("s0", [_datum(rng, T) for T in (9, 14, 5)]),
        TrainBatch("s1", [_datum(rng, T, rl=True) for T in (12, 7)], "importance_sampling"),
        TrainBatch("s2", [_datum(rng, 11)]),
        TrainBatch("s0", [_datum(rng, T) for T in (6, 10)]),
    ]


def requests() -> list[SampleRequest]:
    out = []
    for i, s in enumerate((*SESSIONS, None)):
        params = SampleSpec(max_tokens=6 + 3 * i, temperature=0.9 if i % 2 else 0.0, seed=100 + i)
        out.append(
            SampleRequest([3, 5, 7 + i, 11], num_samples=1 + i % 2, params=params, adapter=s)
        )
    out.append(
        SampleRequest(
            [2, 4, 6], params=SampleSpec(max_tokens=0), adapter="s1", prompt_logprobs=True
        )
    )
    return out


def decode_requests() -> tuple[list[SampleRequest], list[SampleRequest]]:
    """Seeded requests of every kind of weights (adapters, a snapshot, the base), some of
    several samples, one only scored; and those that join mid-generation."""
    first = []
    for i, s in enumerate((*SESSIONS, "snap:s1", None)):
        params = SampleSpec(
            max_tokens=10 + 4 * i, temperature=0.8 if i % 2 else 0.0, seed=200 + i,
            stop_at_eos=False,
        )  # fmt: skip
        first.append(SampleRequest([4, 8, 15 + i, 16, 23][: 3 + i % 3], 1 + i % 2, params, s))
    first.append(SampleRequest([2, 4, 6], params=SampleSpec(max_tokens=0), adapter="s2",
                               prompt_logprobs=True))  # fmt: skip
    joining = [
        SampleRequest([42, 7], 2, SampleSpec(max_tokens=12, temperature=1.0, seed=300), "s0"),
        SampleRequest([5, 5, 5, 5], 1, SampleSpec(max_tokens=7, seed=301), None),
        SampleRequest([9, 1], 1, SampleSpec(max_tokens=9, temperature=0.7, seed=302), "s2"),
        # sampling controls: the same per-row path on whichever rank the request lands
        SampleRequest([3, 9, 1], 2, SampleSpec(
            max_tokens=10, seed=303, repetition_penalty=1.3, logit_bias={3: 2.0}, min_p=0.05,
            constraint=Constraint("regex", "[a-z]{2,8}"),
        ), "s1"),
    ]  # fmt: skip
    return first, joining


def _marker(T: int) -> list[TrainBatch]:
    """A forward of two rows of T positions: one on each rank of two."""
    rng = np.random.default_rng(T)
    return [TrainBatch("s0", [_datum(rng, T), _datum(rng, T)])]


def decode(engine: Any) -> dict[str, Any]:
    """The decode batch as the worker drives it: requests added, YIELD_AFTER steps (until
    says stop), other requests join, then steps to the end, streaming every request."""
    first, joining = decode_requests()
    batch = engine.decode_batch()
    heard: list[tuple] = []
    engine.forward_backward(_marker(START), forward_only=True)
    handles = batch.add(first, stream=[True] * len(first))
    steps = 0

    def until() -> bool:
        nonlocal steps
        steps += 1
        return steps >= YIELD_AFTER

    done = dict(batch.step(until=until, on_tokens=heard.extend))
    engine.forward_backward(_marker(END), forward_only=True)
    out: dict[str, Any] = {"yielded": (steps, sorted(done), len(batch), batch.rows)}
    out["keys"] = batch.adapter_keys()
    handles += batch.add(joining, stream=[k != 1 for k in range(len(joining))])
    while len(batch):
        done.update(batch.step(on_tokens=heard.extend))
    out["results"] = [
        ([q.tokens for q in done[h].sequences], [q.logprobs for q in done[h].sequences])
        for h in handles
    ]
    out["prompt_lps"] = done[handles[len(first) - 1]].prompt_logprobs
    out["streamed"] = {}
    for h, j, pos, tok, lp in heard:
        out["streamed"].setdefault((handles.index(h), j), []).append((pos, tok, lp))
    out["keys_after"] = batch.adapter_keys()
    out["dropped"] = cancelled(batch)
    return out


def cancelled(batch: Any) -> tuple[dict[int, int], list[int], int]:
    """Two requests, two decode steps, then one dropped (a cancel): → tokens it had sampled,
    the other's tokens to its end, and the requests left."""
    keep, gone = batch.add(
        [
            SampleRequest([3, 1, 4], 1, SampleSpec(max_tokens=6, seed=400, stop_at_eos=False)),
            SampleRequest([1, 5], 2, SampleSpec(max_tokens=30, temperature=1.0, seed=401), "s1"),
        ]
    )
    done = dict(batch.step(max_steps=2))
    sampled = batch.drop({gone})
    left = len(batch)
    while len(batch):
        done.update(batch.step())
    assert gone not in done
    return {0: sampled[gone]}, done[keep].sequences[0].tokens, left


def grads(bank: Any, adapter_id: str) -> list[torch.Tensor]:
    return [
        p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        for p in bank.live(adapter_id).parameters()
    ]


def weights(bank: Any, adapter_id: str) -> list[torch.Tensor]:
    return [p.detach().clone() for p in bank.live(adapter_id).parameters()]


def run(engine: Any, bank: Any, files: Path) -> dict[str, Any]:
    """The calls; `bank` is the AdapterBank of the engine (rank 0's own, in a group);
    checkpoints go under `files`."""
    for k, s in enumerate(SESSIONS):
        engine.create_adapter(s, LoraSpec(rank=4 + 2 * k, alpha=16, seed=k))
    out: dict[str, Any] = {"fb": [], "samples": []}
    adam = AdamSpec(learning_rate=1e-2)
    for step in range(STEPS):
        res = engine.forward_backward(mixed_batch(step))
        out["fb"].append([([o["logprobs"] for o in r.outputs], r.metrics["loss:sum"]) for r in res])
        if step == 0:
            out["grads"] = {s: grads(bank, s) for s in SESSIONS}
        for s in SESSIONS:
            engine.optim_step(s, adam)
        if step == 1:  # a call of one row: under FSDP the other rank has nothing to do
            one = engine.forward_backward([TrainBatch("s2", [mixed_batch(50).pop(2).data[0]])])
            out["one"] = [o["logprobs"] for o in one[0].outputs]
        if step == 2:
            fwd = engine.forward_backward(mixed_batch(99), forward_only=True)
            out["forward"] = [[o["logprobs"] for o in r.outputs] for r in fwd]
            engine.snapshot("s1", "snap:s1")
        if step == 3:  # an infinite loss cut between ranks, beside a good batch of its adapter
            calls = [
                [TrainBatch("s0", mixed_batch(53)[0].data[:2]),
                 TrainBatch("s1", [_overflow(50 + k) for k in range(3)], "importance_sampling"),
                 TrainBatch("s1", mixed_batch(52)[1].data, "importance_sampling")],
                [TrainBatch("s1", [_overflow(54)], "importance_sampling")],  # nothing trains
            ]  # fmt: skip
            out["nonfinite"] = [[r.metrics for r in engine.forward_backward(c)] for c in calls]
    out["adapters"] = {s: weights(bank, s) for s in SESSIONS}
    for r in engine.sample(requests()):
        out["samples"].append(
            ([s.tokens for s in r.sequences], [s.logprobs for s in r.sequences], r.prompt_logprobs)
        )
    snap = engine.sample(
        [SampleRequest([1, 2, 3], params=SampleSpec(max_tokens=5, seed=7), adapter="snap:s1")]
    )
    out["snap"] = snap[0].sequences[0].tokens
    out["decode"] = decode(engine)
    # a state saved by rank 0, loaded back (the other ranks get its bytes), and a merged export
    engine.save_state("s1", files / "state-s1")
    engine.load_state("copy", files / "state-s1")
    (copy,) = engine.forward_backward(
        [TrainBatch("copy", mixed_batch(5)[1].data, "importance_sampling")]
    )
    out["copy"] = [o["logprobs"] for o in copy.outputs]
    engine.save_merged("s0", files / "merged-s0")
    return out


def failures(engine: Any) -> dict[str, Any]:
    """Rank 0, after the scenario: a refused request and a failure on rank 1 only; both
    fail the call on every rank and leave the group serving."""
    from treadle.engine.distributed import GroupFailure
    from treadle.errors import InvalidRequestError

    seen: dict[str, Any] = {}
    bad = mixed_batch(7)
    bad[0].data[0].tokens[0] = 10**6  # outside the vocabulary
    try:
        engine.forward_backward(bad)
    except InvalidRequestError as e:
        seen["refused"] = str(e)
    cut = TrainBatch("s2", [_datum(np.random.default_rng(8), T) for T in (5, 30, 30, 30, 30, 30)])
    try:  # rank 1 takes the last rows: 3 of them, which fail there
        engine.forward_backward([cut])
    except GroupFailure as e:
        seen["failed"] = str(e)
    seen |= decode_failures(engine)
    before = engine.forward_backward(mixed_batch(9), forward_only=True)
    again = engine.forward_backward(mixed_batch(9), forward_only=True)
    seen["still_serving"] = all(
        np.array_equal(a["logprobs"], b["logprobs"])
        for x, y in zip(before, again, strict=True)
        for a, b in zip(x.outputs, y.outputs, strict=True)
    )
    return seen


def decode_failures(engine: Any) -> dict[str, Any]:
    """Rank 0: a decode batch whose prefill, then whose decode step, fails on rank 1 only
    (the second request of each add lands there): every rank raises, a failed add leaves
    the batch as it was, and a new batch serves."""
    from treadle.engine.distributed import GroupFailure

    seen: dict[str, Any] = {}
    ok = SampleRequest([1, 2, 3], params=SampleSpec(max_tokens=4, seed=1))
    batch = engine.decode_batch()
    try:
        batch.add([ok, SampleRequest([6, 6, 6], params=SampleSpec(max_tokens=4))])
    except GroupFailure as e:
        seen["add_failed"] = str(e)
    seen["after_failed_add"] = (len(batch), batch.step())
    batch.add([ok, SampleRequest([1, 2, 3], params=SampleSpec(max_tokens=77))])
    try:
        batch.step()
    except GroupFailure as e:
        seen["step_failed"] = str(e)
    batch = engine.decode_batch()
    (h,) = batch.add([ok])
    seen["served"] = [(got, r.sequences[0].tokens) for got, r in batch.step()] == [
        (h, engine.sample([ok])[0].sequences[0].tokens)
    ]
    return seen


def rank_main(rank: int, world: int, port: int, model_dir: str, shard: str, out: str) -> None:
    """One rank of a spawned gloo group: rank 0 runs the scenario, the others follow."""
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    torch.set_num_threads(1)
    from treadle.engine import Engine
    from treadle.engine.distributed import DistributedEngine, init_group

    group = init_group("cpu", shard)
    engine = DistributedEngine(Engine(model_dir), group)
    shards = [
        p.to_local() if hasattr(p, "to_local") else p for p in engine.engine.model.parameters()
    ]
    calls = ModelCalls(engine.engine.model)
    if rank == 1:  # one rank fails inside a call: the call fails everywhere, the group lives
        _fail_on_rank_1()
    if group.leader:
        result = run(engine, engine.engine.bank, Path(out))
        result["base_numel"] = sum(p.numel() for p in shards)
        result["after_failures"] = failures(engine)
        engine.release()
    else:
        engine.follow()
        result = {"adapters": {s: weights(engine.engine.bank, s) for s in (*SESSIONS, "copy")}}
    result["decode_steps"] = calls.between_markers()
    torch.save(result, Path(out) / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()


def _fail_on_rank_1() -> None:
    """Rank 1's own failures: a loss of 3 rows of s2, a prefill of [6, 6, 6], a decode step
    of a row of 77 tokens."""
    from treadle.engine import decode, sample, train

    real_loss, real_prepare, real_forward = (
        train._batch_loss, sample.DecodeBatch.prepare, decode.Cohort.forward
    )  # fmt: skip

    def batch_loss(lp, batch, *rest):
        if batch.adapter_id == "s2" and len(batch.data) == 3:
            raise RuntimeError("rank 1 ran out of memory")
        return real_loss(lp, batch, *rest)

    def prepare(self, requests, stream=None):
        if any(r.prompt == [6, 6, 6] for r in requests):
            raise RuntimeError("rank 1 could not prefill")
        return real_prepare(self, requests, stream)

    def forward(self, engine, tok):
        if bool((self.max_tokens == 77).any()):
            raise RuntimeError("rank 1 could not decode")
        return real_forward(self, engine, tok)

    train._batch_loss = batch_loss
    sample.DecodeBatch.prepare = prepare
    decode.Cohort.forward = forward
