"""Engine faults: an error after which this process cannot serve its model any more.

Some errors leave a device unusable rather than failing one request: a CUDA error other
than out-of-memory poisons the process's CUDA context, and every later call fails too (which
errors count: treadle.engine.device_faults). Failing that op, and every one after it, would
spread one bad moment to every session on the model. Instead, the engine loop raises an
EngineFault out of the executor, carrying the ops that were running. A worker process then
reports them to the API (Kind.FAULT) and exits. Its supervisor starts a new
process on a fresh device context, recovery restores the sessions, and the acknowledged ops
run again (treadle.server.engines.remote).

An op that was running at a fault runs alone when it runs again (`Op.faults`: not merged into
another session's train call, not in the shared decode batch). If it was the cause, the next
fault names it alone. An op running at MAX_FAULTS faults, each in a fresh process, fails
with DeviceFaultError and is not run again. So a request that crashes the device
deterministically (a hostile tenant's, or a bug's) costs the others two restarts, not a loop.
A replay (an op that ran before, run again to restore its model after a crash) cannot be
refused, as its result was given: at MAX_FAULTS its model is unrestorable, and recovery
gives that model up alone (its pending requests fail with the reason). So is a model whose
state crashes the worker that loads it to restore it (`restore_id`: what the flight recorder
and a fault report name while a restore runs), at its MAX_FAULTS-th such crash.

The engine loop dying of any other error in a worker takes the same way out, blaming no op.
An engine on a thread of the API process (`--engine-processes false`) has no process to
restart: its loop dies and its requests fail with EngineDeadError. In a worker group
(treadle.worker.group), a fault on any rank is raised as one at rank 0 (DistributedEngine.
raise_failures), which reports it and exits; torchrun then ends the other ranks.
"""

from __future__ import annotations

from collections.abc import Sequence

from treadle.protocol.ops import Op

MAX_FAULTS = 2
EXIT_ENGINE_FAULT = 76  # a worker's exit status after an engine fault (75: a broken group)


_RESTORE = "restore:"


def restore_id(model_id: str) -> str:
    """What a worker says is running while it loads a model's state to restore it (no
    request id has this form)."""
    return _RESTORE + model_id


def restored_model(running_id: str) -> str | None:
    """The model a `restore_id` names (None: the id is a request's)."""
    return running_id.removeprefix(_RESTORE) if running_id.startswith(_RESTORE) else None


class EngineFault(Exception):
    """The engine cannot go on in this process; `ops` were running when it happened, and
    `running_ids` names them (and a restore, if one was running: `restore_id`)."""

    def __init__(self, cause: BaseException, ops: Sequence[Op] = (), also: Sequence[str] = ()):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause
        self.ops = list(ops)
        self.running_ids = [op.request_id for op in ops] + list(also)
