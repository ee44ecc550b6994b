"""Control calls: what the API asks of a worker's engine thread between rounds, by name
(load or drop a sampler, check an adapter, restore or unload a model, write every model's
state, forget everything), each with a future for its answer.

A call runs on the engine thread before the next round is planned, so that a round never
runs an op of a model a call just removed. A device fault during a call (a restore on a
broken device) is an engine fault like an op's: the worker ends, and the caller hears that
the engine stopped (EngineDeadError), not the fault as the call's own error.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any, NamedTuple

from treadle.errors import EngineDeadError
from treadle.protocol.faults import EngineFault


class Call(NamedTuple):
    """A control call waiting for the engine thread."""

    fn: Callable[[], Any]
    fut: concurrent.futures.Future
    running: list[str]  # what the flight recorder names while it runs


def run_call(
    call: Call,
    engine_name: str,
    check_fault: Callable[[Exception, list, list[str]], None],
    record: Callable[[list[str]], None],
) -> None:
    """Engine thread: run the call and settle its future; an engine fault is raised on
    (after the caller is told the engine stopped)."""
    if call.running:
        record(call.running)
    try:
        call.fut.set_result(call.fn())
    except Exception as e:
        try:
            check_fault(e, [], call.running)
        except EngineFault:
            stopped = f"the engine of model {engine_name!r} failed during this call"
            call.fut.set_exception(EngineDeadError(f"{stopped}: {type(e).__name__}: {e}"))
            raise
        call.fut.set_exception(e)
    except BaseException as e:  # noqa: BLE001 - handed to the caller
        call.fut.set_exception(e)
    finally:
        if call.running:
            record([])
