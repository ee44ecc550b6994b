"""Turns scheduled ops into Engine calls, and their results into typed Outcomes.

Runs on the engine thread only (except `is_live` and `sampling`, which any thread may ask).
Saves go through the CheckpointWriter; the sampler weights in memory (snapshots of training
models, checkpoints loaded for sampling, the "live refs") and state snapshots are kept by
its base, LiveWeights (treadle.worker.live_weights).

Sample ops join the engine's DecodeBatch (`admit_samples`; a worker group's rank 0 has a
GroupDecodeBatch, whose calls every rank runs: treadle.engine.dist_decode) and finish a few
decode steps at a time (`decode`), while other ops run between the steps. The weights a sample op arrived
with stay its weights until it ends (LiveWeights.hold: the engine loop holds them as the op
arrives; a pin or ref is freed only once no op holds it and no decode row is routed to it).
Engines without an incremental sampler (no `decode_batch`) run sample ops to the end in
`admit_samples`.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from treadle.engine.device_faults import is_device_fault
from treadle.engine.loss_graph import custom_loss
from treadle.engine.types import TrainBatch
from treadle.protocol.faults import EngineFault
from treadle.protocol.ops import (
    CreateAdapter,
    LoadResult,
    LoadWeights,
    ModelResult,
    Op,
    OpKind,
    OptimResult,
    OptimStep,
    Outcome,
    Progress,
    SaveResult,
    SaveSampler,
    SaveState,
    Skip,
    Snapshot,
    TrainData,
    Usage,
)
from treadle.protocol.saved import Saved
from treadle.worker.checkpoints import CheckpointWriter
from treadle.worker.idle_writes import Deferred
from treadle.worker.live_weights import LiveWeights
from treadle.worker.outcomes import failure, sample_outcome
from treadle.worker.scheduler import Step

log = logging.getLogger("treadle.executor")


@dataclass
class _Flight:
    """A sample op in the decode batch."""

    op: Op
    started_at: float = field(default_factory=time.time)


class OpExecutor(LiveWeights):
    def __init__(
        self,
        engine: Any,
        writer: CheckpointWriter,
        max_snapshots: int = 8,
        state_root: Path | None = None,
        on_refs: Callable[[list[str], list[str]], None] | None = None,
        vllm: Any = None,
    ):
        super().__init__(engine, max_snapshots, state_root, on_refs)
        self.writer = writer
        # `--sampler vllm`: a VllmSampler (treadle.worker.vllm), which takes the generating
        # sample ops its parity gate allows; None: Treadle's own sampler takes them all
        self.vllm = vllm
        if vllm is not None:
            vllm.is_frozen = lambda key: key.startswith("pin:") or self.is_live(key)
        self._batch: Any = None  # the engine's DecodeBatch, made on first use
        self._flights: dict[int, _Flight] = {}  # by DecodeBatch handle
        self._single: dict[OpKind, Callable[[Op], Outcome | Deferred]] = {
            OpKind.SKIP: self._skip,
            OpKind.CREATE: self._create,
            OpKind.LOAD: self._load,
            OpKind.OPTIM_STEP: self._optim_step,
            OpKind.SAVE_STATE: self._save_state,
            OpKind.SAVE_SAMPLER: self._save_sampler,
            OpKind.SNAPSHOT: self._snapshot,
        }

    def run_step(self, step: Step) -> list[Outcome | Deferred]:
        """One step of a round (treadle.worker.scheduler): a train call, sample ops joining
        the decode batch, or a single op. Errors become failed outcomes (an engine fault is
        raised on)."""
        try:
            if step.kind == "train":
                return list(self.run_train(step.ops, step.forward_only))
            if step.kind == "sample":
                return list(self.admit_samples(step.ops))
            return [self.run_single(step.ops[0])]
        except EngineFault:
            raise
        except Exception as e:  # the methods catch per op; this is a last resort
            log.exception("step %s failed", step.kind)
            return [Outcome.failed(op.request_id, e) for op in step.ops]

    # ---- training: several sessions in one engine call ----
    def run_train(self, ops: list[Op], forward_only: bool) -> list[Outcome]:
        """One engine.forward_backward for all ops; if it fails and held several ops, each
        op is retried alone so that one bad request does not fail the others."""
        batches = []
        try:
            for op in ops:
                p = op.payload
                assert isinstance(p, TrainData)
                custom = custom_loss(p.custom.upload) if p.custom is not None else None
                batches.append(TrainBatch(op.model_id, p.data, p.loss_fn, p.loss_config, custom))
            results = self.engine.forward_backward(batches, forward_only)
            for batch, result in zip(batches, results, strict=True):
                if batch.custom is not None:  # its metrics, from the logprobs of the pass
                    logprobs = [out["logprobs"] for out in result.outputs]
                    result.metrics.update(batch.custom.metrics(batch.data, logprobs))
        except Exception as e:
            self.check_fault(e, ops)
            if len(ops) == 1:
                return [failure(ops[0], e)]
            log.warning("mixed train batch of %d failed (%s); retrying one by one", len(ops), e)
            return [o for op in ops for o in self.run_train([op], forward_only)]
        return [
            Outcome.ok(op.request_id, r, Usage(train_tokens=op.payload.n_tokens))
            for op, r in zip(ops, results, strict=True)
        ]

    # ---- sampling: all requests in one engine call (engines without a DecodeBatch) ----
    def run_samples(self, ops: list[Op]) -> list[Outcome]:
        self.hold(ops)
        try:
            results = self.engine.sample([self.request_of(op) for op in ops])
        except Exception as e:
            self.check_fault(e, ops)
            if len(ops) == 1:
                self.release(ops)
                return [failure(ops[0], e)]
            log.warning("sample batch of %d failed (%s); retrying one by one", len(ops), e)
            return [o for op in ops for o in self.run_samples([op])]
        self.release(ops)
        return [sample_outcome(op, r) for op, r in zip(ops, results, strict=True)]

    # ---- sampling: a decode batch that lives across rounds ----
    @property
    def sampling(self) -> int:
        """Sample ops in the decode batch (any thread may ask)."""
        return len(self._flights)

    def admit_samples(self, ops: list[Op]) -> list[Outcome]:
        """Prefill sample ops and join them to the decode batch: → the outcomes of those
        already over (refused, or needing no decode step come out of the next `decode`).
        If the prefill fails and held several ops, each is tried alone (with the weights it
        holds). An op that was running at an engine fault (one per step: the scheduler's
        rule) runs to its end here, outside the shared decode batch."""
        if not callable(getattr(self.engine, "decode_batch", None)) or ops[0].faults:
            return self.run_samples(ops)
        if self._batch is None:
            self._batch = self._new_batch()
        self.hold(ops)  # those that arrived before their adapter existed
        requests = [self.request_of(op) for op in ops]
        try:
            handles = self._batch.add(requests, stream=[op.payload.stream for op in ops])
        except Exception as e:
            self.check_fault(e, [*ops, *(f.op for f in self._flights.values())])
            if len(ops) == 1:
                self.release(ops)
                return [failure(ops[0], e)]
            log.warning("sample batch of %d failed (%s); retrying one by one", len(ops), e)
            return [o for op in ops for o in self.admit_samples([op])]
        for op, h in zip(ops, handles, strict=True):
            self._flights[h] = _Flight(op)
        return []

    def decode(
        self,
        until: Callable[[], bool],
        on_progress: Callable[[list[Progress]], None] | None = None,
    ) -> list[Outcome]:
        """Decode until `until()` says stop (asked after every step) or a sample op ends:
        → the outcomes of the ops that ended. Streamed ops' tokens go to on_progress after
        every step. A failed step fails every op in the batch."""
        batch = self._batch
        on_tokens = None
        if on_progress is not None and any(f.op.payload.stream for f in self._flights.values()):

            def on_tokens(tokens: list[tuple[int, int, int, int, float]]) -> None:
                by_op: dict[str, list] = {}
                for h, j, pos, tok, lp in tokens:
                    by_op.setdefault(self._flights[h].op.request_id, []).append((j, pos, tok, lp))
                on_progress([Progress(rid, toks) for rid, toks in by_op.items()])

        try:
            finished = batch.step(until=lambda: batch.has_results or until(), on_tokens=on_tokens)
        except Exception as e:
            self.check_fault(e, [f.op for f in self._flights.values()])
            log.exception("a decode step of %d sample ops failed", len(self._flights))
            return [failure(op, e) for op in self.abort_samples()]
        flights = [(self._flights.pop(h), result) for h, result in finished]
        self.release([flight.op for flight, _ in flights])  # and what compaction let go
        return [_sampled(f.op, r).timed(f.started_at) for f, r in flights]

    def cancel_samples(self, request_ids: set[str], error: Exception) -> list[Outcome]:
        """Stop these sample ops where they are in the decode batch (between two decode
        steps): their rows leave it, their slots free, and each fails with `error`, metered
        for what ran (its prompt and the tokens sampled so far)."""
        handles = {h for h, f in self._flights.items() if f.op.request_id in request_ids}
        if not handles or self._batch is None:
            return []
        sampled = self._batch.drop(handles)
        flights = [self._flights.pop(h) for h in handles]
        self.release([f.op for f in flights])
        outcomes = []
        for h, f in zip(handles, flights, strict=True):
            outcome = Outcome.failed(f.op.request_id, error)
            prompt = len(f.op.payload.request.prompt)  # type: ignore[union-attr]
            outcome.usage = Usage(prompt_tokens=prompt, sampled_tokens=sampled.get(h, 0))
            outcomes.append(outcome.timed(f.started_at))
        return outcomes

    def decoding(self) -> list[Op]:
        """The sample ops in the decode batch."""
        return [f.op for f in self._flights.values()]

    def abort_samples(self) -> list[Op]:
        """Forget every sample op in the decode batch (→ them), and the batch itself."""
        flights, self._flights, self._batch = list(self._flights.values()), {}, None
        ops = [f.op for f in flights]
        self.release(ops)
        return ops

    def _routed(self) -> set[str]:
        return self._batch.adapter_keys() if self._batch is not None else set()

    def _new_batch(self) -> Any:
        if self.vllm is None:
            return self.engine.decode_batch()
        from treadle.worker.vllm.batch import VllmDecodeBatch

        return VllmDecodeBatch(self.engine, self.vllm)

    # ---- the vLLM sampler's LoRAs follow the snapshots ----
    def keep_snapshot(self, model_id: str, snap: str) -> None:
        super().keep_snapshot(model_id, snap)
        if self.vllm is not None:
            self.vllm.push(snap)  # loaded now, so the first request does not wait for it

    def _free(self, ref: str) -> None:
        if self.vllm is not None:
            self.vllm.forget(ref)
        super()._free(ref)

    # ---- everything else: one op at a time, in its model's order ----
    def run_single(self, op: Op) -> Outcome | Deferred:
        self.weights_changed(op.model_id)  # a step or a load: sample ops arriving next pin anew
        try:
            return self._single[op.kind](op)
        except Exception as e:
            self.check_fault(e, [op])
            return failure(op, e)

    def check_fault(self, error: Exception, running: list[Op], also: Sequence[str] = ()) -> None:
        """Raise EngineFault if `error`, raised by an engine call, left the device unusable
        (`running`: the ops of that call; `also`: what else it names, a restore's id)."""
        if is_device_fault(error, getattr(self.engine, "device", None)):
            raise EngineFault(error, running, also) from error

    def _skip(self, op: Op) -> Outcome:
        """A request refused at the API edge, holding its seq_id's place in the order."""
        assert isinstance(op.payload, Skip)
        return Outcome.failed(op.request_id, op.payload.error)

    def _create(self, op: Op) -> Outcome:
        assert isinstance(op.payload, CreateAdapter)
        self.engine.create_adapter(op.model_id, op.payload.lora)
        return Outcome.ok(op.request_id, ModelResult(op.model_id, "create_model"))

    def _load(self, op: Op) -> Outcome:
        p = op.payload
        assert isinstance(p, LoadWeights)
        try:
            if p.checkpoint_type == "training":
                self.engine.load_state(op.model_id, p.dir, with_optimizer=p.optimizer)
            else:
                self.engine.load_adapter(op.model_id, p.dir)
        finally:
            if p.cleanup:  # a decrypted or downloaded copy of a version
                shutil.rmtree(p.dir, ignore_errors=True)
        return Outcome.ok(op.request_id, LoadResult(p.path, op.model_id))

    def _optim_step(self, op: Op) -> Outcome:
        assert isinstance(op.payload, OptimStep)
        metrics = self.engine.optim_step(op.model_id, op.payload.adam)
        return Outcome.ok(
            op.request_id, OptimResult({k: float(v) for k, v in (metrics or {}).items()})
        )

    def _save_state(self, op: Op) -> Outcome:
        assert isinstance(op.payload, SaveState)
        return _saved(op, *self.writer.save_state(op.model_id, op.payload))

    def _save_sampler(self, op: Op) -> Deferred:
        """Freeze the weights now (memory only), write them to disk at an idle moment: the
        model's next ops need not wait for the disk."""
        assert isinstance(op.payload, SaveSampler)
        write = self.writer.save_sampler(op.request_id, op.model_id, op.payload)
        return Deferred(op, lambda: _saved(op, *write()), model_id=op.model_id)

    def _snapshot(self, op: Op) -> Outcome:
        """save_weights_for_sampler without a name: a sampler served from memory at once."""
        p = op.payload
        assert isinstance(p, Snapshot)
        snap = f"snap:{p.sampling_session_id}"
        if op.replay:  # recovery: only the weights in memory, recorded once already
            self.engine.snapshot(op.model_id, snap)
            outcome = Outcome.ok(op.request_id, SaveResult(None, "save_weights_for_sampler"))
        else:
            outcome = _saved(op, *self.writer.snapshot(op.model_id, snap, p))
        self.keep_snapshot(op.model_id, snap)
        return outcome


def _sampled(op: Op, result: Any) -> Outcome:
    error = getattr(result, "error", None)  # a sampler that could not finish it says why
    return failure(op, error) if error is not None else sample_outcome(op, result)


def _saved(op: Op, result: SaveResult, saved: Saved) -> Outcome:
    outcome = Outcome.ok(op.request_id, result)
    outcome.saved = saved
    return outcome
