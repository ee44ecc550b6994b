"""Samplers: create_sampling_session, GET samplers/{id}, asample, join_sampling_session."""

from __future__ import annotations

import shutil
from typing import Any

from fastapi import APIRouter

from treadle.server.api.deps import KeyDep, StateDep, TenantDep
from treadle.server.api.tinker import handlers
from treadle.server.api.tinker.weights import fetch_source
from treadle.wire.requests import (
    CreateSamplingSessionRequest,
    CreateSamplingSessionResponse,
    GetSamplerResponse,
    SampleRequest,
)
from treadle.wire.sdk_requests import JoinSamplingSessionRequest

router = APIRouter(prefix="/api/v1")


@router.post("/create_sampling_session")
async def create_sampling_session(
    body: CreateSamplingSessionRequest, state: StateDep, tenant: TenantDep, key: KeyDep
) -> CreateSamplingSessionResponse:
    """Sample from a base model, or from a saved checkpoint (loaded into memory here): a
    tinker:// path or a model package version GROUP:N, fetched and decrypted when needed."""
    source = None
    if body.model_path:
        state.check_adapter_slot(tenant)
        source = await fetch_source(state, tenant.tenant_id, body.model_path, key, False)
    try:
        sid = await state.samplers.create(
            tenant,
            body.session_id,
            body.sampling_session_seq_id,
            body.base_model,
            body.model_path,
            source,
        )
    finally:
        if source is not None and source.cleanup:
            shutil.rmtree(source.dir, ignore_errors=True)
    return CreateSamplingSessionResponse(sampling_session_id=sid)


@router.get("/samplers/{sampler_id}")
async def get_sampler(sampler_id: str, state: StateDep) -> GetSamplerResponse:
    row = await state.samplers.get(sampler_id)
    return GetSamplerResponse(
        sampler_id=row.sampling_session_id, base_model=row.base_model, model_path=row.model_path
    )


@router.post("/asample")
async def asample(body: SampleRequest, state: StateDep, tenant: TenantDep) -> dict:
    return await handlers.asample(state, tenant, body)


@router.post("/join_sampling_session")
async def join_sampling_session(
    body: JoinSamplingSessionRequest, state: StateDep
) -> dict[str, Any]:
    """A copy of a sampling client (unpickled, or from_sampler_handle) → its clone number."""
    counter = await state.samplers.join(body.sampling_session_id)
    return {"type": "join_sampling_session", "client_counter": counter}
