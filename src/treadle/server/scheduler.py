"""The engine loop: one thread per served base model, feeding its Engine in rounds.

Each round, `plan_round` (the scheduling rule, a pure function) picks what may run now; the
worker executes those steps through an OpExecutor and hands the outcomes on (the journal
commits them, then their polls get them from memory). Requests reach the worker in memory,
right after their row is committed; only the engine thread ever touches the Engine.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from treadle.errors import InvalidRequestError, NotFoundError

log = logging.getLogger("treadle.scheduler")

TRAIN_KINDS = ("forward_backward", "forward")
# A deferred durable write waits at most this long for an idle moment before it runs anyway.
DEFERRED_MAX_WAIT_S = 1.0
# Consecutive train ops of one model merged into one engine call hold at most this many tokens.
DEFAULT_MAX_MERGE_TOKENS = 65536


@dataclass
class Op:
    """One queued request: what the engine must do for one future."""

    request_id: str
    kind: str  # create | load | forward_backward | forward | optim_step | save_state |
    #            save_sampler | snapshot | sample
    model_id: str | None = None
    seq_id: int | None = None
    payload: Any = None
    enqueued_at: float = field(default_factory=time.monotonic)


@dataclass
class ModelQueue:
    """Ops of one training model waiting for their turn; `next_seq` is the one due next."""

    next_seq: int = 0
    pending: dict[int, Op] = field(default_factory=dict)


@dataclass
class Step:
    """One engine call: a mixed-session train batch (each model's ops consecutive, in seq_id
    order), one single op, or a sample batch."""

    kind: Literal["train", "single", "sample"]
    ops: list[Op]
    forward_only: bool = False


def plan_round(
    queues: dict[str, ModelQueue],
    samples: list[Op],
    max_sample_batch: int,
    max_merge_tokens: int = DEFAULT_MAX_MERGE_TOKENS,
) -> list[Step]:
    """The scheduling rule: which ops run in this round, grouped into engine calls.

    Invariant: the ops of one model run strictly in seq_id order. A model contributes only
    from its head, the op whose seq_id equals its `next_seq`; a model whose next op has not
    arrived yet (a gap) contributes nothing and waits. Any op that is not
    forward/forward_backward (optim_step, saves, loads, create) is a barrier for its own
    model only: it runs alone as a "single" step while other models keep going.
    A forward/forward_backward head takes along the consecutive ops after it that could
    have run right after it unchanged (same kind, loss_fn and loss_fn_config; no gap, no
    barrier; up to max_merge_tokens in all): the chunks the SDKs split a big batch into run
    as one engine call, and since the weights cannot change between them, each gets exactly
    what it would have got alone (gradients add up the same, up to float rounding).
    Forward_backward runs of all models share ONE engine call, as do forward runs (the
    engine takes forward_only per call); all pending samples (up to max_sample_batch, oldest
    first) share one engine.sample call. Within a round: singles, then train, then sample.
    """
    singles: list[Step] = []
    train: dict[bool, list[list[Op]]] = {False: [], True: []}
    for queue in queues.values():
        head = queue.pending.get(queue.next_seq)
        if head is None:
            continue
        if head.kind in TRAIN_KINDS:
            train[head.kind == "forward"].append(_train_run(queue, head, max_merge_tokens))
        else:
            singles.append(Step("single", [head]))
    steps = singles
    for forward_only in (False, True):
        if train[forward_only]:
            runs = sorted(train[forward_only], key=lambda run: run[0].enqueued_at)
            steps.append(Step("train", [op for run in runs for op in run], forward_only))
    if samples:
        steps.append(
            Step("sample", sorted(samples, key=lambda op: op.enqueued_at)[:max_sample_batch])
        )
    return steps


def _train_run(queue: ModelQueue, head: Op, max_tokens: int) -> list[Op]:
    """The head and the consecutive ops of its model that may share its engine call."""
    run, tokens = [head], _tokens(head)
    while (nxt := queue.pending.get(run[-1].seq_id + 1)) is not None and _same_call(head, nxt):
        tokens += _tokens(nxt)
        if tokens > max_tokens:
            break
        run.append(nxt)
    return run


def _same_call(head: Op, op: Op) -> bool:
    if op.kind != head.kind or not isinstance(op.payload, dict):
        return False
    if not isinstance(head.payload, dict):
        return False
    return all(op.payload.get(k) == head.payload.get(k) for k in ("loss_fn", "loss_fn_config"))


def _tokens(op: Op) -> int:
    data = op.payload.get("data", ()) if isinstance(op.payload, dict) else ()
    return sum(d.model_input.length for d in data)


@dataclass
class Deferred:
    """A durable write to do on the engine thread at an idle moment, then finish the op."""

    op: Op
    run: Callable[[], dict[str, Any]]  # → outcome
    created_at: float = field(default_factory=time.monotonic)


class EngineWorker:
    """Owns one Engine and the thread that calls it.

    `executor` turns steps into outcomes (dicts of RequestRow columns, or Deferred);
    `finish(outcomes)` hands them on to be persisted and delivered (it must not block: the
    next round waits for it). The thread sleeps on a condition until a submit, a call or a
    deferred write wakes it: no timer.
    """

    def __init__(
        self,
        name: str,
        executor: Any,
        finish: Callable[[list[dict[str, Any]]], None],
        max_sample_batch: int = 64,
        max_merge_tokens: int = DEFAULT_MAX_MERGE_TOKENS,
    ):
        self.name = name
        self.executor = executor
        self._finish = finish
        self.max_sample_batch = max_sample_batch
        self.max_merge_tokens = max_merge_tokens
        self.queues: dict[str, ModelQueue] = {}
        self.samples: list[Op] = []
        self.deferred: deque[Deferred] = deque()
        self._calls: deque[tuple[Callable[[], Any], concurrent.futures.Future]] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"engine-{name}", daemon=True)

    # ---- API side (any thread) ----
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout)

    def has_model(self, model_id: str) -> bool:
        with self._cond:
            return model_id in self.queues

    def check_seq(self, model_id: str, seq_id: int) -> None:
        """Refuse a seq_id that already ran (a resubmission was caught before this)."""
        with self._cond:
            queue = self.queues.get(model_id)
            if queue is None:
                raise NotFoundError(f"model_id {model_id!r} is not loaded on this server")
            if seq_id < queue.next_seq or seq_id in queue.pending:
                raise InvalidRequestError(
                    f"seq_id: {seq_id} was already used for model {model_id!r} "
                    f"(next expected: {queue.next_seq})"
                )

    def add_model(self, model_id: str) -> None:
        with self._cond:
            self.queues.setdefault(model_id, ModelQueue())

    def submit(self, op: Op) -> None:
        with self._cond:
            queue = self.queues.get(op.model_id)
            if op.kind == "sample":
                self.samples.append(op)
            elif queue is not None:
                queue.pending[op.seq_id] = op
            self._cond.notify()
        if op.kind != "sample" and queue is None:  # its session ended since the API checked
            error = {"error": f"model {op.model_id!r} was unloaded", "category": "user"}
            self._finish_outcomes(
                [{"request_id": op.request_id, "status": "failed", "error": error}]
            )

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run fn on the engine thread before the next round; → its future."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            self._calls.append((fn, fut))
            self._cond.notify()
        return fut

    def remove_model(self, model_id: str, reason: str) -> list[Op]:
        """Forget a model's queue (engine thread); → its ops that will never run."""
        with self._cond:
            queue = self.queues.pop(model_id, None)
        dropped = list(queue.pending.values()) if queue else []
        # Durable writes of this model were acknowledged as accepted: finish them first.
        for job in [j for j in self.deferred if j.op.model_id == model_id]:
            self.deferred.remove(job)
            self._finish_outcomes([self._run_deferred(job)])
        self._finish_outcomes(
            [
                {
                    "request_id": op.request_id,
                    "status": "failed",
                    "error": {"error": reason, "category": "user"},
                }
                for op in dropped
            ]
        )
        return dropped

    # ---- engine thread ----
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._has_work_locked():
                    self._cond.wait()
                if self._stopping:
                    return
                calls = list(self._calls)
                self._calls.clear()
            # Control calls (drop a session's adapters, load a sampler) go before planning,
            # so that a round never runs an op of a model a call just removed.
            for fn, fut in calls:
                self._run_call(fn, fut)
            with self._cond:
                steps = plan_round(
                    self.queues, self.samples, self.max_sample_batch, self.max_merge_tokens
                )
                for step in steps:
                    if step.kind == "sample":
                        taken = {id(op) for op in step.ops}
                        self.samples = [op for op in self.samples if id(op) not in taken]
            for step in steps:
                self._execute(step)
            self._maybe_run_deferred(idle=not steps)

    def _has_work_locked(self) -> bool:
        if self._calls or self.samples or self.deferred:
            return True
        return any(q.next_seq in q.pending for q in self.queues.values())

    def _run_call(self, fn: Callable[[], Any], fut: concurrent.futures.Future) -> None:
        try:
            fut.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            fut.set_exception(e)

    def _execute(self, step: Step) -> None:
        try:
            if step.kind == "train":
                outcomes = self.executor.run_train(step.ops, step.forward_only)
            elif step.kind == "sample":
                outcomes = self.executor.run_samples(step.ops)
            else:
                outcomes = [self.executor.run_single(step.ops[0])]
        except Exception as e:  # the executor catches per op; this is a last resort
            log.exception("step %s failed", step.kind)
            outcomes = [self.executor.failure(op, e) for op in step.ops]
        ready = []
        for outcome in outcomes:
            if isinstance(outcome, Deferred):
                self.deferred.append(outcome)
            else:
                ready.append(outcome)
        with self._cond:
            for op in step.ops:
                if op.kind != "sample" and op.model_id in self.queues:
                    queue = self.queues[op.model_id]
                    queue.pending.pop(op.seq_id, None)
                    queue.next_seq = op.seq_id + 1
        self._finish_outcomes(ready)

    def _maybe_run_deferred(self, idle: bool) -> None:
        now = time.monotonic()
        while self.deferred and (idle or now - self.deferred[0].created_at > DEFERRED_MAX_WAIT_S):
            self._finish_outcomes([self._run_deferred(self.deferred.popleft())])
            if not idle:
                break

    def _run_deferred(self, job: Deferred) -> dict[str, Any]:
        try:
            return job.run()
        except Exception as e:
            log.exception("deferred write for %s failed", job.op.request_id)
            return self.executor.failure(job.op, e)

    def _finish_outcomes(self, outcomes: list[dict[str, Any]]) -> None:
        if outcomes:
            try:
                self._finish(outcomes)
            except Exception:
                log.exception("could not record %d outcomes", len(outcomes))
