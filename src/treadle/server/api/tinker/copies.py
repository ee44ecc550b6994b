"""Checkpoints that come from elsewhere: copies (copy_weights) and external-weights uploads.

POST /api/v1/copy_weights                     a readable checkpoint → {tinker_path}
POST /api/v1/external_weights_upload_start    files, sizes → {upload_id, urls, expires}
PUT  /api/v1/treadle/uploads/{token}          one file's bytes, at its signed URL, once
POST /api/v1/external_weights_upload_finish   {upload_id} → {tinker_path, size_bytes}
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from treadle.server.api.deps import StateDep, TenantDep
from treadle.server.core import copies, uploads
from treadle.wire.sdk_requests import (
    CopyWeightsRequest,
    ExternalWeightsUploadFinishRequest,
    ExternalWeightsUploadFinishResponse,
    ExternalWeightsUploadStartRequest,
    ExternalWeightsUploadStartResponse,
)

router = APIRouter(prefix="/api/v1")


@router.post("/copy_weights")
async def copy_weights(
    body: CopyWeightsRequest, state: StateDep, tenant: TenantDep
) -> dict[str, Any]:
    """A checkpoint the caller may read (its own, or a published one) → a checkpoint of
    its own in a new run (files shared, not duplicated)."""
    return {"tinker_path": await copies.copy_weights(state, tenant, body)}


@router.post("/external_weights_upload_start")
async def external_weights_upload_start(
    body: ExternalWeightsUploadStartRequest, state: StateDep, tenant: TenantDep, request: Request
) -> ExternalWeightsUploadStartResponse:
    """Start an upload of a PEFT adapter's files: one signed, single-use URL per file."""
    return await uploads.start(state, tenant, body, str(request.base_url).rstrip("/"))


@router.put("/treadle/uploads/{token}")
async def upload_file(token: str, state: StateDep, request: Request) -> dict[str, Any]:
    """One file of an upload, at its signed URL (no API key: the signature is the grant)."""
    return await uploads.receive(state, token, request.stream())


@router.post("/external_weights_upload_finish")
async def external_weights_upload_finish(
    body: ExternalWeightsUploadFinishRequest, state: StateDep, tenant: TenantDep
) -> ExternalWeightsUploadFinishResponse:
    """Check the uploaded adapter like an import (its config, its rank, the engine loads
    it) and make it tinker://<run>/external_weights/<name>."""
    return await uploads.finish(state, tenant, body.upload_id)
