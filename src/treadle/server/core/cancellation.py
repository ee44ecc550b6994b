"""cancel_future: stop an op the client no longer wants.

A queued op never runs: a sample op leaves its engine's queue, a training op becomes a skip
in its seq_id's place (the model's later ops run on, as after any refused request). A
generating sample op leaves the decode batch between two decode steps, its slot free for
others. Each fails with RequestCancelledError, and is metered for what ran: nothing for a
queued op, its prompt and the tokens sampled so far for a generation (treadle.worker.loop
`_cancel`). An op already running in an engine call (a forward_backward, a save) or
finished is not stopped: the reply says so.

The OpenAI routes cancel the ops of a stream whose client went away the same way.
"""

from __future__ import annotations

import functools
from typing import Any

from treadle.errors import NotFoundError
from treadle.server.core.state import ServerState
from treadle.server.storage.queries import request_row
from treadle.server.tenancy.auth import owns


async def cancel(state: ServerState, request_id: str) -> dict[str, Any]:
    """→ {request_id, cancelled, state}: state is cancelled, running (an engine call has it
    now: it finishes) or finished. Another tenant's request is an unknown one (404)."""
    filed = state.futures.board.get(request_id)
    if filed is None or not owns(filed.tenant_id):
        row = await state.journal.run(functools.partial(request_row, request_id=request_id))
        if row is None or not owns(row["tenant_id"]):
            raise NotFoundError(f"request_id {request_id!r} not found")
        return _reply(request_id, "finished" if row["status"] != "pending" else "running")
    if filed.outcome is not None:
        return _reply(request_id, "finished")
    stopped = await cancel_ops(state, [request_id], filed.engine)
    return _reply(request_id, "cancelled" if request_id in stopped else "running")


async def cancel_ops(state: ServerState, request_ids: list[str], engine: str | None) -> list[str]:
    """Ask the engine that has these ops to stop them; → the ids it stopped."""
    handle = state.engines.get(engine) if engine is not None else None
    if handle is None or not request_ids:
        return []
    return list(await handle.call("cancel", request_ids=request_ids) or [])


def _reply(request_id: str, what: str) -> dict[str, Any]:
    return {"request_id": request_id, "cancelled": what == "cancelled", "state": what}
