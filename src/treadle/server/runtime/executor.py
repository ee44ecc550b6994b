"""Turns scheduled ops into Engine calls, and their results into typed Outcomes.

Runs on the engine thread only (except `is_live`, which any thread may ask). Saves go
through the CheckpointWriter; the sampler weights in memory (snapshots of training models,
checkpoints loaded for sampling) are tracked here as "live refs".
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from treadle.engine.types import SampleResult, TrainBatch
from treadle.errors import InvalidRequestError, NotFoundError, TreadleError
from treadle.server.runtime.checkpoint_writer import CheckpointWriter
from treadle.server.runtime.ops import (
    CreateAdapter,
    LoadResult,
    LoadWeights,
    ModelResult,
    Op,
    OpKind,
    OptimResult,
    OptimStep,
    Outcome,
    Sample,
    SaveResult,
    SaveSampler,
    SaveState,
    SequenceRecord,
    Skip,
    Snapshot,
    TrainData,
    Usage,
    sample_sequence_id,
)

log = logging.getLogger("treadle.executor")


@dataclass
class Deferred:
    """A durable write to do on the engine thread at an idle moment, then finish the op (or,
    for a background write such as a state snapshot, `op` None, nothing to finish)."""

    op: Op | None
    run: Callable[[], Outcome | None]
    created_at: float = field(default_factory=time.monotonic)
    model_id: str | None = None


@dataclass
class StateSnapshot:
    """A model's state on disk after op `seq_id`, and the sampler snapshots of it then in
    memory (engine id → folder): what recovery loads before replaying later ops."""

    model_id: str
    seq_id: int
    dir: str
    samplers: dict[str, str] = field(default_factory=dict)


class OpExecutor:
    def __init__(
        self,
        engine: Any,
        writer: CheckpointWriter,
        max_snapshots: int = 8,
        state_root: Path | None = None,
        on_refs: Callable[[list[str], list[str]], None] | None = None,
    ):
        self.engine = engine
        self._on_refs = on_refs  # (added, dropped) sampler refs, for a remote API's mirror
        self.writer = writer
        self.max_snapshots = max_snapshots
        self.state_root = state_root  # where state snapshots go (None: never written)
        self.snapshots: dict[str, deque[str]] = {}  # model_id → its live snapshots, oldest first
        self._persisted: dict[str, str] = {}  # sampler snapshot → its folder on disk
        self._live: set[str] = set()  # engine ids a sampling session may use
        self._live_lock = threading.Lock()
        self._single: dict[OpKind, Callable[[Op], Outcome | Deferred]] = {
            OpKind.SKIP: self._skip,
            OpKind.CREATE: self._create,
            OpKind.LOAD: self._load,
            OpKind.OPTIM_STEP: self._optim_step,
            OpKind.SAVE_STATE: self._save_state,
            OpKind.SAVE_SAMPLER: self._save_sampler,
            OpKind.SNAPSHOT: self._snapshot,
        }

    # ---- training: several sessions in one engine call ----
    def run_train(self, ops: list[Op], forward_only: bool) -> list[Outcome]:
        """One engine.forward_backward for all ops; if it fails and held several ops, each
        op is retried alone so that one bad request does not fail the others."""
        batches = []
        for op in ops:
            p = op.payload
            assert isinstance(p, TrainData)
            batches.append(TrainBatch(op.model_id, p.data, p.loss_fn, p.loss_config))
        try:
            results = self.engine.forward_backward(batches, forward_only)
        except Exception as e:
            if len(ops) == 1:
                return [_failure(ops[0], e)]
            log.warning("mixed train batch of %d failed (%s); retrying one by one", len(ops), e)
            return [o for op in ops for o in self.run_train([op], forward_only)]
        return [
            Outcome.ok(op.request_id, r, Usage(train_tokens=op.payload.n_tokens))
            for op, r in zip(ops, results, strict=True)
        ]

    # ---- sampling: all requests in one engine call ----
    def run_samples(self, ops: list[Op]) -> list[Outcome]:
        try:
            results = self.engine.sample([op.payload.request for op in ops])
        except Exception as e:
            if len(ops) == 1:
                return [_failure(ops[0], e)]
            log.warning("sample batch of %d failed (%s); retrying one by one", len(ops), e)
            return [o for op in ops for o in self.run_samples([op])]
        return [_sample_outcome(op, r) for op, r in zip(ops, results, strict=True)]

    # ---- everything else: one op at a time, in its model's order ----
    def run_single(self, op: Op) -> Outcome | Deferred:
        try:
            return self._single[op.kind](op)
        except Exception as e:
            return _failure(op, e)

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
        return Outcome.ok(op.request_id, self.writer.save_state(op.model_id, op.payload))

    def _save_sampler(self, op: Op) -> Deferred:
        """Freeze the weights now (memory only), write them to disk at an idle moment: the
        model's next ops need not wait for the disk."""
        assert isinstance(op.payload, SaveSampler)
        write = self.writer.save_sampler(op.request_id, op.model_id, op.payload)
        return Deferred(op, lambda: Outcome.ok(op.request_id, write()), model_id=op.model_id)

    def _snapshot(self, op: Op) -> Outcome:
        """save_weights_for_sampler without a name: a sampler served from memory at once."""
        p = op.payload
        assert isinstance(p, Snapshot)
        snap = f"snap:{p.sampling_session_id}"
        if op.replay:  # recovery: only the weights in memory, recorded once already
            self.engine.snapshot(op.model_id, snap)
            result = SaveResult(None, "save_weights_for_sampler")
        else:
            result = self.writer.snapshot(op.model_id, snap, p)
        self._add_live(snap)
        kept = self.snapshots.setdefault(op.model_id, deque())
        kept.append(snap)
        while len(kept) > self.max_snapshots:
            self.drop_ref(kept.popleft())
        return Outcome.ok(op.request_id, result)

    # ---- sampler weights in memory ----
    def is_live(self, ref: str) -> bool:
        with self._live_lock:
            return ref in self._live

    def _add_live(self, ref: str) -> None:
        with self._live_lock:
            self._live.add(ref)
        if self._on_refs is not None:
            self._on_refs([ref], [])

    def load_sampler(self, ref: str, checkpoint_type: str, directory: str) -> None:
        """A sampler from a saved checkpoint: loaded as an adapter of its own."""
        if checkpoint_type == "training":
            self.engine.load_state(ref, directory, with_optimizer=False)
        else:
            self.engine.load_adapter(ref, directory)
        self._add_live(ref)

    def check_adapter(self, directory: str) -> None:
        """Load a PEFT adapter folder under a throwaway id and free it: does it fit?"""
        probe = f"probe:{uuid.uuid4().hex}"
        try:
            self.engine.load_adapter(probe, directory)
        except TreadleError:
            raise
        except Exception as e:  # unreadable weights, a malformed config: the sender's fault
            raise InvalidRequestError(
                f"body: not a loadable PEFT adapter for this model: {type(e).__name__}: {e}"
            ) from e
        self.engine.drop_adapter(probe)

    # ---- durability: state snapshots and restoring from them ----
    def snapshot_state(self, model_id: str, seq_id: int) -> StateSnapshot:
        """Write the model's state (adapter, AdamW, step, accumulated gradients) and its
        sampler snapshots not yet on disk; the folder is new, complete before it is named."""
        assert self.state_root is not None
        root = self.state_root / _safe(model_id)
        final = root / f"state-{seq_id}-{uuid.uuid4().hex[:8]}"
        tmp = root / f".tmp-{final.name}"
        tmp.mkdir(parents=True)
        self.engine.save_snapshot(model_id, tmp)
        tmp.rename(final)
        samplers = {}
        for ref in self.snapshots.get(model_id, ()):
            if ref not in self._persisted:
                folder = root / "samplers" / _safe(ref)
                shutil.rmtree(folder, ignore_errors=True)
                self.engine.save_adapter(ref, folder)
                self._persisted[ref] = str(folder)
            samplers[ref] = self._persisted[ref]
        return StateSnapshot(model_id, seq_id, str(final), samplers)

    def restore_model(self, model_id: str, state_dir: str | None, samplers: dict[str, str]) -> None:
        """A model as its last snapshot left it (or nothing yet: its create op replays),
        with the sampler snapshots it had then."""
        if state_dir is not None:
            self.engine.load_snapshot(model_id, state_dir)
        kept = self.snapshots.setdefault(model_id, deque())
        for ref, folder in samplers.items():
            if ref in kept:
                continue
            self.engine.load_frozen(ref, folder)
            self._persisted[ref] = folder
            self._add_live(ref)
            kept.append(ref)

    def drop_ref(self, ref: str) -> None:
        with self._live_lock:
            if ref not in self._live:
                return
            self._live.discard(ref)
        if self._on_refs is not None:
            self._on_refs([], [ref])
        folder = self._persisted.pop(ref, None)
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
        try:
            if ref.startswith("snap:"):
                self.engine.drop_snapshot(ref)
            else:
                self.engine.drop_adapter(ref)
        except Exception:
            log.exception("could not free %s", ref)

    def drop_all_refs(self) -> None:
        with self._live_lock:
            refs = list(self._live)
        for ref in refs:
            self.drop_ref(ref)
        self.snapshots.clear()

    def drop_model(self, model_id: str) -> None:
        for snap in self.snapshots.pop(model_id, deque()):
            self.drop_ref(snap)
        try:
            self.engine.drop_adapter(model_id)
        except NotFoundError:
            pass  # never created (its create op had not run)
        except Exception:
            log.exception("could not drop adapter %s", model_id)


def _safe(name: str) -> str:
    """An engine id as one folder name (ids hold ':')."""
    return name.replace("/", "_").replace(":", "_")


def _failure(op: Op, exc: BaseException) -> Outcome:
    outcome = Outcome.failed(op.request_id, exc)
    if outcome.error.category == "server":
        log.error("request %s (%s) failed", op.request_id, op.kind, exc_info=exc)
    return outcome


def _sample_outcome(op: Op, result: SampleResult) -> Outcome:
    p = op.payload
    assert isinstance(p, Sample)
    req = p.request
    if not req.prompt_logprobs:
        result.prompt_logprobs = None
    if req.topk_prompt_logprobs <= 0:
        result.topk_prompt_logprobs = None
    if p.prompt_logprobs_last_n is not None:
        cut = len(req.prompt) - p.prompt_logprobs_last_n  # positions before the last N
        if result.prompt_logprobs:
            result.prompt_logprobs = [None] * cut + list(result.prompt_logprobs[cut:])
        if result.topk_prompt_logprobs:
            result.topk_prompt_logprobs = [None] * cut + list(result.topk_prompt_logprobs[cut:])
    sampled = sum(len(s.tokens) for s in result.sequences)
    outcome = Outcome.ok(
        op.request_id, result, Usage(prompt_tokens=len(req.prompt), sampled_tokens=sampled)
    )
    if p.record is not None:  # record_stability_info: kept with the result, for provenance
        outcome.records = [
            SequenceRecord(
                sample_sequence_id(op.request_id, i),  # as the submit reply listed them
                p.record.tenant_id,
                p.record.session_id,
                list(req.prompt),
                list(s.tokens),
                list(s.logprobs),
            )
            for i, s in enumerate(result.sequences)
        ]
    return outcome
