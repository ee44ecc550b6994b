"""Training models: create, info, forward/forward_backward (protobuf), optim_step.

The routes of the hot path are async: they read memory only and await the journal's
commit, so a call costs no hop to a worker thread.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from treadle.errors import InvalidRequestError
from treadle.server import handlers
from treadle.server.deps import ServiceDep
from treadle.types import GetInfoResponse, ModelData
from treadle.wire.requests import (
    CreateModelRequest,
    GetInfoRequest,
    OptimStepRequest,
    UnloadModelRequest,
)

router = APIRouter(prefix="/api/v1")


@router.post("/create_model")
async def create_model(body: CreateModelRequest, svc: ServiceDep) -> dict[str, Any]:
    return await handlers.create_model(svc, body)


@router.post("/get_info")
async def get_info(body: GetInfoRequest, svc: ServiceDep) -> GetInfoResponse:
    row = svc.require_model(body.model_id)
    arch = getattr(getattr(svc.engines[row.base_model], "model", None), "config", None)
    return GetInfoResponse(
        model_data=ModelData(
            arch=getattr(arch, "model_type", None),
            model_name=row.base_model,
            tokenizer_id=row.base_model,
        ),
        model_id=row.model_id,
        optimizer_config={"type": "adamw"},
        is_lora=True,
        lora_rank=row.lora_config.get("rank"),
        model_name=row.base_model,
    )


@router.post("/forward_backward")
async def forward_backward(request: Request, svc: ServiceDep) -> dict[str, Any]:
    """Body: a protobuf ForwardBackwardRequest (zstd-compressed if Content-Encoding says so)."""
    body = await request.body()
    if request.headers.get("content-encoding", "").lower() == "zstd":
        try:
            import zstandard
        except ImportError as e:
            raise InvalidRequestError("Content-Encoding: zstd is not supported here") from e
        try:
            body = zstandard.ZstdDecompressor().decompress(body)
        except zstandard.ZstdError as e:
            raise InvalidRequestError(f"body: Content-Encoding zstd but not zstd data ({e})") from e
    return await handlers.forward_backward(svc, body)


@router.post("/optim_step")
async def optim_step(body: OptimStepRequest, svc: ServiceDep) -> dict[str, Any]:
    return await handlers.optim_step(svc, body)


@router.post("/unload_model")
async def unload_model(body: UnloadModelRequest, svc: ServiceDep) -> dict[str, Any]:
    """Free the model's adapter at once (the treadle SDK calls it when a client is done)."""
    return {"request_id": await svc.unload_model(body.model_id), "model_id": body.model_id}
