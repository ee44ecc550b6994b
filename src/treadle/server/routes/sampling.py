"""Samplers: create_sampling_session, GET samplers/{id}, asample."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from treadle.server import handlers
from treadle.server.deps import ServiceDep
from treadle.wire.requests import (
    CreateSamplingSessionRequest,
    CreateSamplingSessionResponse,
    GetSamplerResponse,
    SampleRequest,
)

router = APIRouter(prefix="/api/v1")


@router.post("/create_sampling_session")
async def create_sampling_session(
    body: CreateSamplingSessionRequest, svc: ServiceDep
) -> CreateSamplingSessionResponse:
    """Sample from a base model, or from a saved checkpoint (loaded into memory here)."""
    return CreateSamplingSessionResponse(
        sampling_session_id=await svc.create_sampling_session(body)
    )


@router.get("/samplers/{sampler_id}")
async def get_sampler(sampler_id: str, svc: ServiceDep) -> GetSamplerResponse:
    row = await svc.sampler(sampler_id)
    return GetSamplerResponse(
        sampler_id=row.sampling_session_id, base_model=row.base_model, model_path=row.model_path
    )


@router.post("/asample")
async def asample(body: SampleRequest, svc: ServiceDep) -> dict[str, Any]:
    return await handlers.asample(svc, body)
