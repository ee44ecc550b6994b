"""Samplers: create_sampling_session, GET samplers/{id}, asample."""

from __future__ import annotations

import shutil
from typing import Any

from fastapi import APIRouter, Request

from treadle.server import handlers
from treadle.server.deps import ServiceDep, TenantDep
from treadle.server.routes.weights import fetch_source
from treadle.wire.requests import (
    CreateSamplingSessionRequest,
    CreateSamplingSessionResponse,
    GetSamplerResponse,
    SampleRequest,
)

router = APIRouter(prefix="/api/v1")


@router.post("/create_sampling_session")
async def create_sampling_session(
    body: CreateSamplingSessionRequest, svc: ServiceDep, tenant: TenantDep, request: Request
) -> CreateSamplingSessionResponse:
    """Sample from a base model, or from a saved checkpoint (loaded into memory here): a
    tinker:// path or a model package version GROUP:N, fetched and decrypted when needed."""
    source = None
    if body.model_path:
        source = await fetch_source(svc, tenant.tenant_id, body.model_path, request, False)
    try:
        sid = await svc.create_sampling_session(body, source)
    finally:
        if source is not None and source.cleanup:
            shutil.rmtree(source.dir, ignore_errors=True)
    return CreateSamplingSessionResponse(sampling_session_id=sid)


@router.get("/samplers/{sampler_id}")
async def get_sampler(sampler_id: str, svc: ServiceDep) -> GetSamplerResponse:
    row = await svc.sampler(sampler_id)
    return GetSamplerResponse(
        sampler_id=row.sampling_session_id, base_model=row.base_model, model_path=row.model_path
    )


@router.post("/asample")
async def asample(body: SampleRequest, svc: ServiceDep) -> dict[str, Any]:
    return await handlers.asample(svc, body)
