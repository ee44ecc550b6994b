"""The engine loop: the thread of a worker that feeds its Engine in rounds.

Each round, `plan_round` (the scheduling rule, treadle.worker.scheduler) picks what
may run now; the loop executes those steps through an OpExecutor and hands the outcomes on
(the worker sends them to the API, which commits them, then their polls get them). Only the
engine thread ever touches the Engine. The thread sleeps on a condition until a submit, a
control call or a deferred write wakes it: no timer.

The loop owns its models' order: each model's queue opens with its first op (seq_id 0: a
create, or a load that creates) or a restore, and runs its ops strictly in seq_id order; an op whose model has no queue (it
was unloaded, or never made here) fails at once, and so does one whose seq_id already ran.

Sampling does not hold the thread for a whole generation: new sample ops join the engine's
decode batch, and each round ends with a slice of decode steps, which stops as soon as
another op can run (`yield_decode`) or a sample op ends. A forward_backward submitted while
another session generates 512 tokens waits for one decode step, not for the generation.
Tokens of streamed sample ops go to `on_progress` after every step.

If the loop itself dies (an error outside any one op), every queued op fails with
EngineDeadError and so does every later submit: a future never waits on a dead engine.
Given `on_fault` (a worker), an engine fault (treadle.protocol.faults) or the loop's death
goes there instead, and the worker ends: the API runs the acknowledged ops again on a new
one. `on_running` hears the request ids of each engine call before it
starts (and [] when it ends), for a crash that leaves no time to say (treadle.worker.
flight_recorder); a restore of a model's state is named by its `restore_id`, so that a
model whose state crashes every worker that loads it is given up, not restored forever.

Durability: when a model's snapshot is due (treadle.worker.idle_writes), its state is
written at an idle moment (executor.snapshot_state) and announced with the seq_id it
covers; recovery loads the last one and replays the ops after it (ops marked `replay`,
whose outcomes nobody hears again).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from treadle.errors import (
    EngineDeadError,
    InvalidRequestError,
    NotFoundError,
)
from treadle.protocol.facts import EngineFacts, SnapshotPolicy, StateSnapshot
from treadle.protocol.faults import EngineFault, restore_id
from treadle.protocol.messages import WorkerStats
from treadle.protocol.ops import STATE_KINDS, Op, OpKind, Outcome, Progress
from treadle.worker.call_spans import trace_call
from treadle.worker.calls import Call, run_call
from treadle.worker.controls import control_calls
from treadle.worker.executor import OpExecutor
from treadle.worker.idle_writes import Deferred, DeferredWrites, run_deferred
from treadle.worker.scheduler import (
    DEFAULT_MAX_MERGE_TOKENS,
    DEFAULT_PARK_LIMITS,
    ModelQueue,
    ParkLimits,
    Step,
    enqueue,
    expire_parked,
    parked_deadline,
    plan_round,
    runnable_samples,
    yield_decode,
)

log = logging.getLogger("treadle.engine_loop")

# A slice of decode steps ends after this long even with nothing else to do, so that the
# round's housekeeping (parked deadlines, deferred writes) runs.
DECODE_SLICE_S = 0.5

# A model's first op (seq_id 0) makes it: a create, or a load (create_training_client_from_state)
_OPENS = frozenset({OpKind.CREATE, OpKind.LOAD})

OnOutcomes = Callable[[list[Outcome]], None]  # engine thread; must not block
OnProgress = Callable[[list[Progress]], None]  # tokens of streamed sample ops, each step
OnSnapshot = Callable[[StateSnapshot], None]  # a model's state was written


class EngineLoop:
    """One Engine (through its OpExecutor) and the thread that runs it; every method but the
    engine thread's own is safe from any thread."""

    def __init__(
        self,
        facts: EngineFacts,
        executor: OpExecutor,
        on_outcomes: OnOutcomes,
        max_sample_batch: int = 64,
        max_merge_tokens: int = DEFAULT_MAX_MERGE_TOKENS,
        on_snapshot: OnSnapshot | None = None,
        snapshots: SnapshotPolicy | None = None,
        park: ParkLimits = DEFAULT_PARK_LIMITS,
        on_progress: OnProgress | None = None,
        on_fault: Callable[[EngineFault], None] | None = None,
        on_running: Callable[[list[str]], None] | None = None,
    ):
        self.facts = facts
        self._on_fault = on_fault
        self._on_running = on_running
        self._on_progress = on_progress
        self.park = park
        self.executor = executor
        self._on_outcomes = on_outcomes
        self._on_snapshot = on_snapshot
        self.max_sample_batch = max_sample_batch
        self.max_merge_tokens = max_merge_tokens
        self.queues: dict[str, ModelQueue] = {}
        self.samples: list[Op] = []
        self.arrived: list[Op] = []  # sample ops whose weights the next round holds
        snapshots_on = on_snapshot is not None and executor.state_root is not None
        self.writes = DeferredWrites(snapshots or SnapshotPolicy(), snapshots_on)
        self._calls: deque[Call] = deque()
        self.cond = threading.Condition()
        self._stopping = False
        # what the heartbeat reports (treadle.protocol.messages.WorkerStats): engine thread
        # writes, the channel thread reads a copy (`stats()`); counters only grow
        self._stats = WorkerStats()
        self._in_call = 0  # ops of the engine call running now
        self._dead: EngineDeadError | None = None
        self._controls = control_calls(self)
        self._thread = threading.Thread(target=self._run, name=f"engine-{self.name}", daemon=True)

    @property
    def name(self) -> str:
        return self.facts.name

    # ---- any thread ----
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        with self.cond:
            self._stopping = True
            self.cond.notify_all()
        self._thread.join(timeout_s)

    def add_model(self, model_id: str, next_seq: int = 0) -> None:
        """Open a model's queue (a create op opens its own; a restore opens it at next_seq)."""
        with self.cond:
            self.queues.setdefault(model_id, ModelQueue(next_seq=next_seq))

    def submit(self, op: Op) -> None:
        """Queue an op; its Outcome reaches on_outcomes (never raises)."""
        refused: Outcome | None = None
        with self.cond:
            if op.seq_id == 0 and op.kind in _OPENS:  # a new model's queue opens
                self.queues.setdefault(op.model_id, ModelQueue())
            if self._dead is not None:
                refused = Outcome.failed(op.request_id, self._dead)
            elif op.kind == OpKind.SAMPLE:
                self.samples.append(op)
                self.arrived.append(op)
            elif (queue := self.queues.get(op.model_id)) is not None:
                if (why := enqueue(queue, op, self.park)) is not None:  # order and bounds
                    refused = Outcome.failed(op.request_id, why)
            else:  # unloaded (its session ended since the API checked), or never made here
                refused = Outcome.failed(
                    op.request_id, NotFoundError(f"model {op.model_id!r} was unloaded")
                )
            self.cond.notify()
        if refused is not None:
            self.finish([refused])

    # ---- control calls: run on the engine thread before the next round ----
    def control(self, name: str, **args: Any) -> concurrent.futures.Future:
        """Run the named control call on the engine thread (what a worker's CALL names)."""
        fn = self._controls.get(name)
        if fn is None:
            fut: concurrent.futures.Future = concurrent.futures.Future()
            fut.set_exception(InvalidRequestError(f"unknown control call {name!r}"))
            return fut
        running = [restore_id(args["model_id"])] if name == "restore_model" else []
        return self.call(lambda: fn(**args), running)

    def call(
        self, fn: Callable[[], Any], running: list[str] | None = None
    ) -> concurrent.futures.Future:
        """Run `fn` on the engine thread before the next round (`running`: what the flight
        recorder names meanwhile)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self.cond:
            if self._dead is not None:
                fut.set_exception(self._dead)
                return fut
            self._calls.append(Call(fn, fut, running or []))
            self.cond.notify()
        return fut

    def busy(self) -> bool:
        """Whether anything is queued or deferred (a draining worker waits for False)."""
        with self.cond:
            busy = self.samples or self.writes or self._calls or self.executor.sampling
            return bool(busy) or any(q.pending for q in self.queues.values())

    # ---- the engine thread ----
    def _run(self) -> None:
        try:
            self._rounds()
        except BaseException as e:  # noqa: BLE001 - the loop is gone: say so to everyone
            fault = e if isinstance(e, EngineFault) else EngineFault(e)
            log.critical("engine loop of %s stopped: %s", self.name, fault, exc_info=e)
            if self._on_fault is not None:
                self._on_fault(fault)  # a worker: it exits, and the API runs the ops again
            self._die(fault.cause)

    def _rounds(self) -> None:
        while True:
            with self.cond:
                while not self._stopping and not self._has_work_locked():
                    if not self.cond.wait(self._parked_wait_s()):
                        break  # a parked op's deadline
                if self._stopping:
                    return
                calls = list(self._calls)
                self._calls.clear()
                now = time.monotonic()
                expired = [
                    o
                    for m, q in self.queues.items()
                    for o in expire_parked(m, q, now, self.park.timeout_s)
                ]
            self.finish(expired)
            # Control calls (drop a session's adapters, load a sampler) go before planning,
            # so that a round never runs an op of a model a call just removed.
            for call in calls:
                run_call(call, self.name, self.executor.check_fault, self._record)
            with self.cond:
                # taken with the plan: every sample op the plan can run is held before it
                # runs, and only once (one held later, after it ended, would hold forever)
                arrived, self.arrived = self.arrived, []
                ready = self._runnable_samples_locked()
                steps = plan_round(self.queues, ready, self._room(), self.max_merge_tokens)
                for step in steps:
                    if step.kind == "sample":
                        taken = {id(op) for op in step.ops}
                        self.samples = [op for op in self.samples if id(op) not in taken]
            # A sample op answers from the weights of its arrival, whatever this round runs
            # before it joins the decode batch (an optim_step filed after it, a full batch).
            if arrived:
                self.executor.hold(arrived)
            for step in steps:
                self._execute(step)
            decoding = self.executor.sampling > 0
            if decoding:
                self._decode()
            self._maybe_run_deferred(idle=not steps and not decoding)

    def _room(self) -> int:
        """How many more sample ops the decode batch takes (max_sample_batch in all)."""
        return self.max_sample_batch - self.executor.sampling

    def _decode(self) -> None:
        """A slice of decode steps, until other work can run or a sample op ends."""
        deadline = time.monotonic() + DECODE_SLICE_S

        stats = self._stats

        def until() -> bool:  # asked after every decode step
            stats.decode_steps += 1
            stats.decode_rows += self.executor.sampling
            if time.monotonic() > deadline:
                return True
            with self.cond:
                if self._stopping or self._calls:
                    return True
                return yield_decode(self.queues, self._runnable_samples_locked(), self._room())

        progress = self._progress if self._on_progress is not None else None
        decoding = self.executor.decoding()
        self._running(decoding)
        outcomes = self.executor.decode(until, progress)  # type: ignore[arg-type]
        self._running([])
        for o in outcomes:  # a sample op's engine call: from joining the batch to its end
            op = next((d for d in decoding if d.request_id == o.request_id), None)
            if op is not None and op.trace and o.started_at and o.finished_at:
                trace_call("decode", [op], o.started_at, o.finished_at)
        self.finish(outcomes)

    def _running(self, ops: list[Op]) -> None:
        self._in_call = len(ops)
        self._record([op.request_id for op in ops])

    def stats(self) -> WorkerStats:
        """A copy of the loop's figures (any thread): the worker's heartbeat body."""
        s = self._stats
        sampling = self.executor.sampling
        return WorkerStats(
            running=max(self._in_call, sampling),
            decode_batch=sampling,
            calls=dict(s.calls),
            decode_steps=s.decode_steps,
            decode_rows=s.decode_rows,
            sampler=vllm.counts() if (vllm := getattr(self.executor, "vllm", None)) else {},
        )

    def _record(self, running_ids: list[str]) -> None:
        if self._on_running is not None:
            self._on_running(running_ids)

    def _progress(self, items: list[Progress]) -> None:
        if items:
            try:
                self._on_progress(items)  # type: ignore[misc]
            except Exception:
                log.exception("could not report the progress of %d sample ops", len(items))

    def _die(self, error: BaseException) -> None:
        dead = EngineDeadError(
            f"the engine of model {self.name!r} stopped: {type(error).__name__}: {error}"
        )
        with self.cond:
            self._dead = dead
            ops = [*self.samples, *(op for q in self.queues.values() for op in q.pending.values())]
            ops += [job.op for job in self.writes.take() if job.op is not None]
            ops += self.executor.abort_samples()
            calls = list(self._calls)
            self.samples, self.queues, self._calls, self.arrived = [], {}, deque(), []
            self.writes.clear()
        for call in calls:
            call.fut.set_exception(dead)
        self.finish([Outcome.failed(op.request_id, dead) for op in ops])

    def _parked_wait_s(self) -> float | None:
        """Until the first deadline of an op parked behind a gap (None: no such op)."""
        deadlines = [parked_deadline(q, self.park.timeout_s) for q in self.queues.values()]
        first = min((d for d in deadlines if d is not None), default=None)
        return None if first is None else max(0.0, first - time.monotonic())

    def _has_work_locked(self) -> bool:
        if self._calls or self.writes or self.executor.sampling:
            return True
        if self._runnable_samples_locked():
            return True
        return any(q.next_seq in q.pending for q in self.queues.values())

    def _runnable_samples_locked(self) -> list[Op]:
        return runnable_samples(self.queues, self.samples, self.executor.is_live)

    def _execute(self, step: Step) -> None:
        started = time.time()  # the console's request timeline (Outcome.timed)
        self._running(step.ops)
        outcomes = self.executor.run_step(step)
        self._running([])
        calls = self._stats.calls
        calls[step.kind] = calls.get(step.kind, 0) + 1
        ready = []
        for outcome in outcomes:
            if isinstance(outcome, Deferred):
                self.writes.add(outcome)
            else:
                ready.append(outcome.timed(started))
        if any(op.trace for op in step.ops):  # tracing is on (treadle.protocol.tracing)
            ends = {o.request_id: o.finished_at for o in ready}
            trace_call(step.kind, step.ops, started, time.time(), ends)
        with self.cond:
            for op in step.ops:
                if op.kind != OpKind.SAMPLE and op.model_id in self.queues:
                    queue = self.queues[op.model_id]
                    queue.pending.pop(op.seq_id, None)
                    queue.next_seq = op.seq_id + 1
        for op in step.ops:
            if op.kind in STATE_KINDS:
                self.writes.note_change(op, self.snapshot)
        self.finish(ready)

    # ---- state snapshots ----
    def snapshot(self, model_id: str) -> None:
        """Engine thread: write the model's state as it is now, with the seq_id it covers."""
        with self.cond:
            queue = self.queues.get(model_id)
            seq_id = queue.next_seq - 1 if queue is not None else -1
        if seq_id < 0:
            return
        self.writes.snapshotted(model_id)
        t0 = time.monotonic()
        snap: StateSnapshot = self.executor.snapshot_state(model_id, seq_id)
        snap.seconds = time.monotonic() - t0
        self._on_snapshot(snap)

    def _maybe_run_deferred(self, idle: bool) -> None:
        for job in self.writes.due(idle):
            self.finish([run_deferred(job)])

    def finish(self, outcomes: list[Outcome | None]) -> None:
        outcomes = [o for o in outcomes if o is not None]
        if outcomes:
            try:
                self._on_outcomes(outcomes)
            except Exception:
                log.exception("could not record %d outcomes", len(outcomes))
