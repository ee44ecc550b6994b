"""retrieve_future: the long poll every future of the protocol goes through."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from treadle.server.deps import ServiceDep
from treadle.wire.requests import FutureRetrieveRequest

router = APIRouter(prefix="/api/v1")


@router.post("/retrieve_future")
async def retrieve_future(
    body: FutureRetrieveRequest, request: Request, svc: ServiceDep
) -> Response:
    """Held until the result is written (or long_poll_s → try_again). ForwardBackwardOutput
    and SampleResponse come as protobuf when Accept names application/x-protobuf, else JSON."""
    want_proto = "application/x-protobuf" in request.headers.get("accept", "")
    content, media_type = await svc.retrieve(body.request_id, want_proto)
    return Response(content=content, media_type=media_type)
