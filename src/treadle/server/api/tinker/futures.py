"""retrieve_future: the long poll every future of the protocol goes through."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from treadle.server.api.deps import StateDep
from treadle.server.api.tinker.replies import reply
from treadle.wire.requests import FutureRetrieveRequest

router = APIRouter(prefix="/api/v1")


@router.post("/retrieve_future")
async def retrieve_future(
    body: FutureRetrieveRequest, request: Request, state: StateDep
) -> Response:
    """Held until the result is written (or long_poll_s → try_again). ForwardBackwardOutput
    and SampleResponse come as protobuf when Accept names application/x-protobuf, else JSON."""
    want_proto = "application/x-protobuf" in request.headers.get("accept", "")
    polled = await state.futures.poll(body.request_id)
    content, media_type = reply(body.request_id, polled, want_proto)
    return Response(content=content, media_type=media_type)
