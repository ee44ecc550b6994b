"""The SDK's routes for capture sessions (treadle.client.capture), under
/api/v1/treadle/captures: create one, read its records, attach rewards, export datums.
Every route acts on the caller's tenant's captures only: another tenant's name is not found.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel

from treadle.server.api.deps import TenantDep
from treadle.server.core.captures import Captures, check_name

router = APIRouter(prefix="/api/v1/treadle/captures")


async def get_captures(request: Request) -> Captures:
    return request.app.state.openai.captures


CapturesDep = Annotated[Captures, Depends(get_captures)]


class CreateCapture(BaseModel):
    capture_id: str | None = None


class Rewards(BaseModel):
    rewards: list[dict[str, Any]]


class Export(BaseModel):
    trajectory_ids: list[str] | None = None
    normalize_std: bool = False


@router.post("")
async def create_capture(body: CreateCapture, captures: CapturesDep, tenant: TenantDep) -> dict:
    return {"capture_id": await captures.create(tenant.tenant_id, body.capture_id)}


@router.get("/{capture_id}/completions")
async def completions(capture_id: str, captures: CapturesDep, tenant: TenantDep) -> dict:
    check_name(capture_id, "capture_id")
    return {"completions": await captures.completions(tenant.tenant_id, capture_id)}


@router.post("/{capture_id}/rewards")
async def set_rewards(
    capture_id: str, body: Rewards, captures: CapturesDep, tenant: TenantDep
) -> dict:
    check_name(capture_id, "capture_id")
    return {"set": await captures.set_rewards(tenant.tenant_id, capture_id, body.rewards)}


@router.post("/{capture_id}/datums")
async def export_datums(
    capture_id: str, body: Export, captures: CapturesDep, tenant: TenantDep
) -> dict:
    check_name(capture_id, "capture_id")
    datums, trajectories = await captures.export(
        tenant.tenant_id, capture_id, body.trajectory_ids, body.normalize_std
    )
    return {
        "datums": [d.model_dump(mode="json", exclude_none=True) for d in datums],
        "trajectories": trajectories,
    }
