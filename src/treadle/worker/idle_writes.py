"""Durable writes the engine thread makes at idle moments, and when a state snapshot is due.

Two kinds of job wait here: a sampler's save (`save_weights_for_sampler`: the op was
acknowledged, its outcome comes when the write is done) and a model's background state
snapshot (no op: recovery loads the last snapshot and replays the ops after it). A job runs
when the engine has nothing else to do, or after DEFERRED_MAX_WAIT_S anyway, one per round.

A snapshot is due every `every_steps` optimizer steps (or loads) of a model, or
`every_s` seconds after its first change since the last one (SnapshotPolicy).

Only the engine thread changes these jobs; the loop's lock guards what other threads read
(whether anything is pending).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from treadle.protocol.facts import SnapshotPolicy
from treadle.protocol.ops import Op, OpKind, Outcome

log = logging.getLogger("treadle.engine_loop")  # the engine loop runs these jobs

# A deferred durable write waits at most this long for an idle moment before it runs anyway.
DEFERRED_MAX_WAIT_S = 1.0


@dataclass
class Deferred:
    """A durable write to do on the engine thread at an idle moment, then finish the op (or,
    for a background write such as a state snapshot, `op` None, nothing to finish)."""

    op: Op | None
    run: Callable[[], Outcome | None]
    created_at: float = field(default_factory=time.monotonic)
    model_id: str | None = None


class DeferredWrites:
    """The jobs waiting for an idle moment, and each model's changes since its snapshot."""

    def __init__(self, policy: SnapshotPolicy, snapshots: bool):
        self.policy = policy
        self.snapshots = snapshots  # whether state snapshots are written at all
        self.jobs: deque[Deferred] = deque()
        self._changed: dict[str, tuple[int, float]] = {}  # model → (state ops, first at)

    def __bool__(self) -> bool:
        return bool(self.jobs)

    def add(self, job: Deferred) -> None:
        self.jobs.append(job)

    def note_change(self, op: Op, snapshot: Callable[[str], None]) -> None:
        """Count a state change of op's model; when its snapshot is due, queue
        `snapshot(model_id)` (once: a snapshot already queued covers this change too)."""
        if not self.snapshots:
            return
        count, since = self._changed.get(op.model_id, (0, time.monotonic()))
        count += op.kind == OpKind.OPTIM_STEP or op.kind == OpKind.LOAD
        self._changed[op.model_id] = (count, since)
        due = count >= self.policy.every_steps or time.monotonic() - since > self.policy.every_s
        # a load from a temporary copy cannot be replayed: its state is written at once
        if due or (op.kind == OpKind.LOAD and op.payload.cleanup):
            if not any(j.op is None and j.model_id == op.model_id for j in self.jobs):
                model = op.model_id
                self.jobs.append(Deferred(None, lambda: snapshot(model), model_id=model))

    def due(self, idle: bool) -> Iterator[Deferred]:
        """The jobs to run now: all of them when the engine is idle, else the oldest one if
        it has waited too long."""
        now = time.monotonic()
        while self.jobs and (idle or now - self.jobs[0].created_at > DEFERRED_MAX_WAIT_S):
            yield self.jobs.popleft()
            if not idle:
                return

    def take(self, model_id: str | None = None) -> list[Deferred]:
        """Remove and return the jobs of a model (of every model: None), oldest first."""
        taken = [j for j in self.jobs if model_id is None or j.model_id == model_id]
        for job in taken:
            self.jobs.remove(job)
        return taken

    def changed(self) -> list[str]:
        """The models changed since their last snapshot."""
        return list(self._changed)

    def snapshotted(self, model_id: str) -> None:
        """The model's state was just written (or the model is gone): count from nothing."""
        self._changed.pop(model_id, None)

    def clear(self) -> None:
        self.jobs.clear()
        self._changed.clear()


def run_deferred(job: Deferred) -> Outcome | None:
    """Run a job; → its op's outcome, timed (None for a background write). A failed
    background write is logged; a failed op's write fails the op."""
    started = time.time()
    try:
        outcome = job.run()
        return outcome.timed(started) if outcome is not None else None
    except Exception as e:
        if job.op is None:
            log.exception("background write for %s failed", job.model_id)
            return None
        log.exception("deferred write for %s failed", job.op.request_id)
        return Outcome.failed(job.op.request_id, e).timed(started)
