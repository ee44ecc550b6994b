"""Training models: create, info, forward/forward_backward (protobuf), optim_step, unload,
and the custom losses a forward_backward may name (create_custom_loss).

The routes of the hot path are async: they read memory only and await the journal's
commit, so a call costs no hop to a worker thread.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from treadle.server.api.deps import StateDep, TenantDep
from treadle.server.api.tinker import handlers
from treadle.server.api.tinker.bodies import read_body
from treadle.types import GetInfoResponse, ModelData
from treadle.wire.requests import (
    CreateModelRequest,
    GetInfoRequest,
    OptimStepRequest,
    UnloadModelRequest,
)
from treadle.wire.sdk_requests import CreateCustomLossRequest

router = APIRouter(prefix="/api/v1")


@router.post("/create_model")
async def create_model(body: CreateModelRequest, state: StateDep, tenant: TenantDep) -> dict:
    return await handlers.create_model(state, tenant, body)


@router.post("/get_info")
async def get_info(body: GetInfoRequest, state: StateDep) -> GetInfoResponse:
    row = state.models.require(body.model_id)
    facts = state.engines.facts(row.base_model)
    return GetInfoResponse(
        model_data=ModelData(
            arch=facts.arch, model_name=row.base_model, tokenizer_id=row.base_model
        ),
        model_id=row.model_id,
        optimizer_config={"type": "adamw"},
        is_lora=True,
        lora_rank=row.lora_config.get("rank"),
        model_name=row.base_model,
    )


@router.post("/forward_backward")
async def forward_backward(request: Request, state: StateDep, tenant: TenantDep) -> dict:
    """Body: a protobuf ForwardBackwardRequest (zstd-compressed if Content-Encoding says so)."""
    body = await read_body(request, state.config.limits.max_body_bytes)
    return await handlers.forward_backward(state, tenant, body)


@router.post("/optim_step")
async def optim_step(body: OptimStepRequest, state: StateDep, tenant: TenantDep) -> dict:
    return await handlers.optim_step(state, tenant, body)


@router.post("/create_custom_loss")
async def create_custom_loss(
    body: CreateCustomLossRequest, state: StateDep, tenant: TenantDep
) -> dict[str, Any]:
    """A traced loss graph (ServiceClient.create_custom_loss), checked against the allowed
    ops and kept for forward_backward(loss_fn="custom") of its session; → a future of
    {"loss_id"}."""
    rid = await state.custom_losses.create(
        tenant, body.session_id, body.custom_loss_seq_id, body.name, body.inputs, body.graph
    )
    return {"request_id": rid}


@router.post("/unload_model")
async def unload_model(body: UnloadModelRequest, state: StateDep) -> dict[str, Any]:
    """Free the model's adapter at once (the treadle SDK calls it when a client is done)."""
    return {"request_id": await state.models.unload(body.model_id), "model_id": body.model_id}
