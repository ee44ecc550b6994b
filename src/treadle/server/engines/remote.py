"""Engines in workers, seen from the API: one WorkerEngine (an EngineClient) per worker group
of a served model (the hub they connect to: treadle.server.engines.hub).

A worker (treadle.worker) connects its DEALER socket to the hub's ROUTER and says HELLO
(its model, its facts, the hub's token); the hub answers WELCOME and hands it to the
WorkerEngine of its model. The worker owns its models' state (their seq_id order, their
adapters); the WorkerEngine keeps, on the API side, only what survives the worker: every op
sent but not finished, the faults counted against ops across workers, and a cache of the
sampler weights the worker says it holds. When its worker goes silent (no heartbeat for
`dead_after_s`) or ends, the engine is down: ops wait in the outbox, and when a worker of
the model is back, `on_ready` restores the models (treadle.server.core.recovery), then the
unfinished ops are sent again, in their order. A future never hangs: if no worker returns
within `give_up_after_s`, the engine's unfinished ops fail with EngineDeadError. The faults
counted against ops, and the models they make unrestorable, are kept in its FaultLedger
(treadle.server.engines.fault_ledger).

A replica given up (its model cannot load: treadle.server.engines.restarts) fails its ops,
now and later, with EngineDeadError naming why, until a worker says HELLO again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from treadle.errors import DeviceFaultError, EngineDeadError
from treadle.protocol import messages
from treadle.protocol.facts import EngineFacts, ReplicaStatus, StateSnapshot
from treadle.protocol.messages import Kind
from treadle.protocol.ops import Op, Outcome, Progress
from treadle.server.engines.client import EngineClient, OnOutcomes, OnProgress, OnSnapshot
from treadle.server.engines.fault_ledger import FaultLedger
from treadle.server.observe import metrics

if TYPE_CHECKING:
    from treadle.server.engines.hub import WorkerHub

log = logging.getLogger("treadle.remote")


class WorkerEngine(EngineClient):
    def __init__(
        self,
        name: str,
        hub: WorkerHub,
        on_outcomes: OnOutcomes,
        on_snapshot: OnSnapshot,
        on_ready: Callable[[WorkerEngine], Awaitable[None]],
        loop: asyncio.AbstractEventLoop,
        give_up_after_s: float = 120.0,
        replica: int = 0,
        on_progress: OnProgress | None = None,
    ):
        self.facts = EngineFacts(name, vocab_size=0, max_seq_len=0, max_lora_rank=0)
        self.replica = replica
        self._on_progress = on_progress
        self.hub = hub
        self._on_outcomes = on_outcomes
        self._on_snapshot = on_snapshot
        self._on_ready = on_ready
        self._loop = loop
        self.give_up_after_s = give_up_after_s
        self._lock = threading.Lock()
        self._identity: bytes | None = None
        self._ready = False  # a worker is connected and its models are restored
        self._down_since: float | None = time.monotonic()
        self._live: set[str] = set()
        self._sent: dict[str, Op] = {}  # every op handed to this engine and not finished
        self._outbox: list[Op] = []  # ops waiting for a worker
        self.faults = FaultLedger(name)  # faults counted against ops across workers
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self.worker: messages.Hello | None = None
        # what the metrics know of the workers (treadle.server.observe.metrics)
        self._faulted = False  # the worker said FAULT: its loss is counted as that cause
        self._stats = messages.WorkerStats()  # its last heartbeat's
        self.attaches = 0  # workers that said HELLO so far
        self.failure: str | None = None  # why this replica was given up (no worker comes)

    # ---- EngineClient ----
    def stop(self) -> None:
        """Ask the worker to drain and end (a worker this server did not start)."""
        with self._lock:
            identity = self._identity
        if identity is not None:
            self.hub.send(identity, Kind.SHUTDOWN, b"")

    def submit(self, op: Op) -> None:
        with self._lock:
            if self.failure is not None and self._identity is None and not op.replay:
                self._outcomes_later([Outcome.failed(op.request_id, self._down_error())])
                return
            if op.replay:
                self.faults.replay_sent(op)
            self._sent[op.request_id] = op
            if not self._ready and not op.replay:
                self._outbox.append(op)
                return
            identity = self._identity
        self._send_op(identity, op)

    async def call(self, name: str, **args: Any) -> Any:
        with self._lock:
            if self._identity is None and self.failure is not None:
                raise self._down_error()
            if self._identity is None:
                raise EngineDeadError(
                    f"the engine of model {self.name!r} is restarting; retry in a few seconds"
                )
        value = await asyncio.wrap_future(self._call_nowait(name, **args))
        if name == "restore_model":
            with self._lock:  # its state loads well
                self.faults.state_loaded(args["model_id"])
        return value

    def status(self) -> list[ReplicaStatus]:
        hello = self.worker
        state = self.state()
        pid, device = (hello.pid or None, hello.device) if hello else (None, None)
        reason = self.failure if state == "down" else None
        live = self._stats if self._identity is not None else messages.WorkerStats()
        return [
            ReplicaStatus(
                self.replica,
                state,
                pid,
                device,
                (),
                len(self._sent),
                running=live.running,
                decode_batch=live.decode_batch,
                reason=reason,
            )
        ]

    def is_live(self, ref: str) -> bool:
        with self._lock:
            return ref in self._live

    def unrestorable(self, model_id: str) -> str | None:
        """Why a model must not be restored here (replaying its op log kept faulting the
        engine: treadle.protocol.faults), or None."""
        with self._lock:
            return self.faults.unrestorable.get(model_id)

    def state(self) -> str:
        """serving, restoring (a worker is here, its models coming back) or down."""
        with self._lock:
            if self._ready:
                return "serving"
            return "restoring" if self._identity is not None else "down"

    # ---- facts for the hub and recovery ----
    @property
    def ready(self) -> bool:
        return self._ready

    def unfinished(self) -> list[Op]:
        """Ops handed to this engine whose outcome has not come back (oldest first)."""
        with self._lock:
            return list(self._sent.values())

    @property
    def has_worker(self) -> bool:
        return self._identity is not None

    def down_for(self) -> float | None:
        """Seconds since the worker went away (None: it is here)."""
        with self._lock:
            return None if self._down_since is None else time.monotonic() - self._down_since

    def take_model(self, model_id: str) -> list[Op]:
        """Forget a model moving to another replica; → its ops not finished here."""
        with self._lock:
            ops = [op for op in self._sent.values() if op.model_id == model_id]
            for op in ops:
                del self._sent[op.request_id]
            self._outbox = [op for op in self._outbox if op.model_id != model_id]
        return [op for op in ops if not op.replay]

    # ---- the worker's side of things (the hub's IO thread) ----
    def give_up(self, reason: str) -> None:
        """No worker of this replica is started again: what waits for one fails now, with
        the reason, and so does every later op (until a worker says HELLO anyway)."""
        with self._lock:
            self.failure = reason
            if self._identity is not None:
                return
            ops, self._sent, self._outbox = list(self._sent.values()), {}, []
            error = self._down_error()
        failed = [Outcome.failed(op.request_id, error) for op in ops if not op.replay]
        if failed:
            self._outcomes_later(failed)

    def _down_error(self) -> EngineDeadError:
        return EngineDeadError(f"model {self.name!r} is down: {self.failure}")

    def attach(self, identity: bytes, hello: messages.Hello) -> None:
        """A worker of this model said HELLO: restore (on the event loop), then resend."""
        with self._lock:
            self._identity = identity
            self.attaches += 1
            self.failure = None
            self._ready = False
            self._live.clear()
            self.facts = hello.facts
            # the same worker saying HELLO again (it lost the API, or the API lost it) is no
            # restart, and its counters go on; a new worker counts from 0
            restarted = self.worker is not None and self.worker.worker_id != hello.worker_id
            if self.worker is None or restarted:
                self._stats = messages.WorkerStats()
            self.worker = hello
            self._faulted = False
            # replays of an earlier restore that never finished: the new one replays again
            for rid, op in list(self._sent.items()):
                if op.replay:
                    del self._sent[rid]
        log.info("worker %s (pid %s) serves %s", hello.worker_id, hello.pid, self.name)
        if restarted:
            metrics.WORKER_RESTARTS.labels(self.name).inc()
        asyncio.run_coroutine_threadsafe(self._restore(), self._loop)

    def lost(self, reason: str) -> None:
        """The worker went away: nothing is sent until one is back (and restored)."""
        with self._lock:
            if self._identity is None:
                return
            self._identity, self._ready = None, False
            self._down_since = time.monotonic()
            calls = list(self._calls.values())
            self._calls.clear()
            cause = "engine_fault" if self._faulted else metrics.fault_cause(reason)
        if cause != "clean":
            metrics.ENGINE_FAULTS.labels(self.name, cause).inc()
        log.warning("the worker of %s is gone (%s); waiting for a new one", self.name, reason)
        dead = EngineDeadError(f"the engine of {self.name!r} restarted during this call")
        for fut in calls:
            fut.set_exception(dead)

    def handle(self, kind: Kind, body: bytes) -> None:
        if kind == Kind.OUTCOMES:
            self._got_outcomes(messages.decode_outcomes(body))
        elif kind == Kind.PROGRESS:
            self._got_progress(messages.decode(body, messages.ProgressMsg).items)
        elif kind == Kind.REPLY:
            reply = messages.decode(body, messages.Reply)
            with self._lock:
                fut = self._calls.pop(reply.call_id, None)
            if fut is not None and not fut.done():
                if reply.error is not None:
                    fut.set_exception(reply.error.to_exception())
                else:
                    fut.set_result(reply.value)
        elif kind == Kind.REFS:
            refs = messages.decode(body, messages.Refs)
            with self._lock:
                self._live.update(refs.added)
                self._live.difference_update(refs.dropped)
        elif kind == Kind.SNAPSHOT:
            snap = messages.decode(body, StateSnapshot)
            metrics.SNAPSHOT_SECONDS.labels(self.name).observe(snap.seconds)
            self._on_snapshot(snap)
        elif kind == Kind.FAULT:
            fault = messages.decode(body, messages.Fault)
            log.error("the engine of %s faulted (%s)", self.name, fault.error)
            self._faulted = True
            self.blame(fault.request_ids, fault.error)
        elif kind == Kind.HEARTBEAT:
            self._heard_stats(messages.decode(body, messages.WorkerStats))

    def _heard_stats(self, now: messages.WorkerStats) -> None:
        """A heartbeat's figures: its counters' growth since the last beat goes to the
        metrics (the hub's IO thread, the only one that writes _stats)."""
        last, name = self._stats, self.name
        for kind, n in now.calls.items():
            grown = n - last.calls.get(kind, 0)
            if grown > 0:
                metrics.ENGINE_CALLS.labels(name, kind).inc(grown)
        if now.decode_steps > last.decode_steps:
            metrics.DECODE_STEPS.labels(name).inc(now.decode_steps - last.decode_steps)
        if now.decode_rows > last.decode_rows:
            metrics.DECODE_ROWS.labels(name).inc(now.decode_rows - last.decode_rows)
        for event, n in now.sampler.items():
            grown = n - last.sampler.get(event, 0)
            if grown > 0:
                metrics.SAMPLER_EVENTS.labels(name, event).inc(grown)
        self._stats = now

    def tick(self) -> None:
        """Hub thread: fail everything if the worker has been gone too long."""
        with self._lock:
            down = self._down_since
            if self._identity is not None or down is None:
                return
            if time.monotonic() - down < self.give_up_after_s:
                return
            if not self._sent:
                return
            ops, self._sent, self._outbox = list(self._sent.values()), {}, []
        dead = EngineDeadError(
            f"the engine of model {self.name!r} has been down for over "
            f"{self.give_up_after_s:.0f} s; retry later"
        )
        self._outcomes_later([Outcome.failed(op.request_id, dead) for op in ops if not op.replay])

    # ---- internals ----
    async def _restore(self) -> None:
        t0 = time.monotonic()
        try:
            await self._on_ready(self)
            metrics.RESTORE_SECONDS.labels(self.name).observe(time.monotonic() - t0)
        except EngineDeadError as e:  # its worker went away: the next one restores again
            log.warning("restoring the models of %s stopped: %s", self.name, e)
            return
        except Exception:
            log.exception("restoring the models of %s failed", self.name)
            return
        with self._lock:
            self._ready, self._down_since = True, None
            identity = self._identity
            # the ops of a model the restore gave up fail here, with the reason
            lost = [op for op in self._sent.values() if op.model_id in self.faults.unrestorable]
            for op in lost:
                del self._sent[op.request_id]
            failed = [
                Outcome.failed(
                    op.request_id, DeviceFaultError(self.faults.unrestorable[op.model_id])
                )
                for op in lost
                if not op.replay
            ]
            outbox = [op for op in self._outbox if op.model_id not in self.faults.unrestorable]
            self._outbox = []
            waiting = {op.request_id for op in outbox}
            resend = [
                op for op in self._sent.values() if not op.replay and op.request_id not in waiting
            ]
        if failed:
            self._outcomes_later(failed)
        # in their order: what was in flight when the worker went away, then what waited
        for op in sorted(resend, key=_order) + outbox:
            self._send_op(identity, op)

    def _send_op(self, identity: bytes | None, op: Op) -> None:
        if identity is not None:
            self.hub.send(identity, Kind.OP, messages.encode_op(op, op.encoded))

    def _got_outcomes(self, outcomes: list[Outcome]) -> None:
        heard = []
        with self._lock:
            for o in outcomes:
                op = self._sent.pop(o.request_id, None)
                if op is None:
                    continue  # failed already (the engine was down too long)
                if op.replay:
                    self.faults.replay_ran(o.request_id)
                else:
                    heard.append(o)
        if heard:
            self._on_outcomes(heard)

    def blame(self, request_ids: list[str], error: str) -> None:
        """The worker's engine faulted (or the worker crashed) with these ops running
        (treadle.server.engines.fault_ledger)."""
        with self._lock:
            given_up, skips = self.faults.blame(self._sent, request_ids, error)
            if skips:
                self._outbox = [skips.get(o.request_id, o) for o in self._outbox]
        if given_up:
            self._outcomes_later(given_up)

    def _got_progress(self, items: list[Progress]) -> None:
        """Tokens of streamed ops still in flight (none of replays, nor of ops given up)."""
        if self._on_progress is None:
            return
        with self._lock:
            heard = [p for p in items if (op := self._sent.get(p.request_id)) and not op.replay]
        if heard:
            self._on_progress(heard)

    def _outcomes_later(self, outcomes: list[Outcome]) -> None:
        # never from under our lock: the callback takes the journal's
        threading.Thread(target=self._on_outcomes, args=(outcomes,), daemon=True).start()

    def _call_nowait(self, name: str, **args: Any) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            identity = self._identity
            if identity is None:
                # nothing to tell: the restore after the worker's return sets it up
                fut.set_result(None)
                return fut
            call_id = next(self._call_ids)
            self._calls[call_id] = fut
        body = messages.encode(messages.Call(call_id, name, args))
        self.hub.send(identity, Kind.CALL, body)
        return fut


def _order(op: Op) -> tuple[int, float]:
    return (op.seq_id if op.seq_id is not None else -1, op.enqueued_at)
