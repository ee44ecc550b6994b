"""Futures: retrieve_future (the long poll every future of the protocol goes through),
retrieve_futures (one long poll per sampling client) and cancel_future."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response

from treadle.server.api.deps import StateDep, TenantDep
from treadle.server.api.tinker.replies import reply
from treadle.server.core import cancellation
from treadle.server.core.queue_state import queue_state
from treadle.wire.requests import FutureRetrieveRequest
from treadle.wire.sdk_requests import CancelFutureRequest, FuturesRetrieveRequest

router = APIRouter(prefix="/api/v1")


@router.post("/retrieve_future")
async def retrieve_future(
    body: FutureRetrieveRequest, request: Request, state: StateDep
) -> Response:
    """Held until the result is written (or long_poll_s → try_again, with the queue's
    state). ForwardBackwardOutput and SampleResponse come as protobuf when Accept names
    application/x-protobuf, else JSON."""
    want_proto = "application/x-protobuf" in request.headers.get("accept", "")
    polled = await state.futures.poll(body.request_id)
    queue = queue_state(state, body.request_id) if polled.finished is None else ("active", None)
    content, media_type = reply(body.request_id, polled, want_proto, queue)
    return Response(content=content, media_type=media_type)


@router.post("/retrieve_futures")
async def retrieve_futures(
    body: FuturesRetrieveRequest, state: StateDep, tenant: TenantDep
) -> dict[str, Any]:
    """The sample requests of one sampling client that finished after `prev_cursor`
    ({completions, cursor}); their results come from retrieve_future."""
    target = body.target
    await state.samplers.get(target.sampling_session_id)  # the caller's, else 404
    completions, cursor = await state.completions.poll(
        (target.sampling_session_id, target.cloned_sampler_id),
        tenant.tenant_id,
        body.prev_cursor,
        body.timeout,
    )
    return {"completions": completions, "cursor": cursor}


@router.post("/cancel_future")
async def cancel_future(body: CancelFutureRequest, state: StateDep) -> dict[str, Any]:
    """Stop a queued op, or a generation between two decode steps; → {request_id,
    cancelled, state}."""
    return await cancellation.cancel(state, body.request_id)
