"""The control calls a worker's API sends (CALL messages: treadle.worker.calls), by name.

Each runs on the engine thread before the loop's next round (EngineLoop.control), so that
a round never runs an op of a model a call just removed. They change the loop's own state
(its models' queues, its waiting sample ops, its deferred writes) under its condition, and
the engine's through its executor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from treadle.errors import ErrorInfo, NotFoundError, RequestCancelledError
from treadle.protocol.ops import Op, OpKind, Outcome, Skip
from treadle.worker.idle_writes import run_deferred
from treadle.worker.scheduler import ModelQueue

if TYPE_CHECKING:
    from treadle.worker.loop import EngineLoop


def control_calls(loop: EngineLoop) -> dict[str, Callable[..., Any]]:
    """name → what it runs (its CALL's arguments are its keyword arguments)."""
    ex = loop.executor
    return {
        "load_sampler": ex.load_sampler,
        "drop_ref": ex.drop_ref,
        "check_adapter": ex.check_adapter,
        "unload_model": lambda model_id, reason: unload(loop, model_id, reason),
        "restore_model": lambda **args: restore(loop, **args),
        "snapshot_all": lambda: snapshot_all(loop),
        "reset": lambda: reset(loop),
        "cancel": lambda request_ids: cancel(loop, request_ids),
    }


def restore(
    loop: EngineLoop, model_id: str, state_dir: str | None, samplers: dict[str, str], next_seq: int
) -> None:
    """A model's state (and its samplers) loaded again; its queue opens at next_seq."""
    loop.executor.restore_model(model_id, state_dir, samplers)
    with loop.cond:
        loop.queues[model_id] = ModelQueue(next_seq=next_seq)


def reset(loop: EngineLoop) -> None:
    """Forget every model and sampler (a new API took over: it restores what it knows)."""
    with loop.cond:
        models = list(loop.queues)
        waiting = loop.samples
        loop.queues, loop.samples, loop.arrived = {}, [], []
        loop.writes.clear()
    loop.executor.release(waiting)
    loop.executor.abort_samples()
    for model_id in models:
        loop.executor.drop_model(model_id)
    loop.executor.drop_all_refs()


def cancel(loop: EngineLoop, request_ids: list[str]) -> list[str]:
    """Stop these ops (→ the ids stopped). A queued sample op leaves the queue; a generating
    one leaves the decode batch between two decode steps, metered for what it sampled; a
    queued training op becomes a skip in its seq_id's place, so the model's later ops run
    on. An op running in an engine call now, or finished, is not stopped."""
    ids = set(request_ids)
    error = RequestCancelledError("cancelled (cancel_future) before it finished")
    skip = Skip(ErrorInfo.of(error))
    with loop.cond:
        dropped = [op for op in loop.samples if op.request_id in ids]
        loop.samples = [op for op in loop.samples if op.request_id not in ids]
        loop.arrived = [op for op in loop.arrived if op.request_id not in ids]
        skipped = []
        for queue in loop.queues.values():
            for seq, op in list(queue.pending.items()):
                if op.request_id in ids and op.kind != OpKind.SKIP and not op.replay:
                    queue.pending[seq] = Op(op.request_id, OpKind.SKIP, skip, op.model_id, seq)
                    skipped.append(op.request_id)
    loop.executor.release(dropped)  # the weights they held since they arrived
    outcomes = [Outcome.failed(op.request_id, error) for op in dropped]
    outcomes += loop.executor.cancel_samples(ids, error)
    loop.finish(outcomes)
    return [o.request_id for o in outcomes] + skipped


def snapshot_all(loop: EngineLoop) -> None:
    """Every changed model's state now (at shutdown), after the writes already deferred."""
    for job in loop.writes.take():
        loop.finish([run_deferred(job)])
    for model_id in loop.writes.changed():
        loop.snapshot(model_id)


def unload(loop: EngineLoop, model_id: str, reason: str) -> None:
    """Fail the model's queued ops, finish its durable writes, free it."""
    with loop.cond:
        queue = loop.queues.pop(model_id, None)
    # Durable writes of this model were acknowledged as accepted: finish them first (a
    # state snapshot, op None, of a model being freed is dropped: nothing replays it).
    for job in loop.writes.take(model_id):
        if job.op is not None:
            loop.finish([run_deferred(job)])
    dropped = list(queue.pending.values()) if queue else []
    loop.finish([Outcome.failed(op.request_id, NotFoundError(reason)) for op in dropped])
    loop.writes.snapshotted(model_id)
    loop.executor.drop_model(model_id)
