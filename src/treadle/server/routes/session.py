"""Client bootstrap, sessions, health and stubs the Tinker SDK calls."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body
from sqlalchemy import select

from treadle.errors import NotFoundError
from treadle.server.db import ModelRow, SamplingSessionRow, SessionRow
from treadle.server.deps import ServiceDep, TenantDep
from treadle.server.service import SessionGoneError
from treadle.types import SupportedModel
from treadle.wire.requests import (
    ClientConfigResponse,
    ClientDynamicConfigResponse,
    CreateSessionRequest,
    CreateSessionResponse,
    GetServerCapabilitiesResponse,
    GetSessionResponse,
    HealthResponse,
    ListSessionsResponse,
    SessionFinishRequest,
    SessionHeartbeatRequest,
    SessionHeartbeatResponse,
    TelemetryResponse,
)

router = APIRouter(prefix="/api/v1")
OptionalJson = Annotated[dict[str, Any] | None, Body()]


@router.get("/healthz")
async def healthz() -> HealthResponse:
    """Answered once every model is loaded (the lifespan loads them before serving)."""
    return HealthResponse()


@router.post("/client/config")
async def client_config(body: OptionalJson = None) -> ClientConfigResponse:
    return ClientConfigResponse()


@router.post("/client/dynamic_config")
async def client_dynamic_config(
    body: OptionalJson = None,
) -> ClientDynamicConfigResponse:
    return ClientDynamicConfigResponse()


@router.get("/get_server_capabilities")
async def get_server_capabilities(svc: ServiceDep) -> GetServerCapabilitiesResponse:
    models = [
        SupportedModel(model_name=name, max_context_length=int(engine.max_seq_len))
        for name, engine in svc.engines.items()
    ]
    return GetServerCapabilitiesResponse(supported_models=models)


@router.post("/create_session")
async def create_session(body: CreateSessionRequest, svc: ServiceDep) -> CreateSessionResponse:
    return CreateSessionResponse(session_id=await svc.create_session(body))


@router.post("/session_heartbeat")
async def session_heartbeat(
    body: SessionHeartbeatRequest, svc: ServiceDep
) -> SessionHeartbeatResponse:
    svc.require_session(body.session_id)
    return SessionHeartbeatResponse()


@router.post("/sessions/{session_id}/finish")
async def finish_session(
    session_id: str, svc: ServiceDep, body: Annotated[SessionFinishRequest | None, Body()] = None
) -> dict[str, Any]:
    """close(): idempotent; a session already ended answers {} too."""
    try:
        svc.require_session(session_id)
    except SessionGoneError:
        return {}
    await svc.end_session(session_id, "finished")
    return {}


@router.post("/telemetry")
async def telemetry(body: OptionalJson = None) -> TelemetryResponse:
    return TelemetryResponse()


@router.get("/sessions")
def list_sessions(
    svc: ServiceDep, tenant: TenantDep, limit: int = 20, offset: int = 0
) -> ListSessionsResponse:
    rows = svc.store.query(
        select(SessionRow)
        .where(SessionRow.tenant_id == tenant.tenant_id)
        .order_by(SessionRow.created_at.desc())
        .offset(offset)
        .limit(limit)
    )
    return ListSessionsResponse(sessions=[r.session_id for r in rows])


@router.get("/sessions/{session_id}")
def get_session(session_id: str, svc: ServiceDep, tenant: TenantDep) -> GetSessionResponse:
    row = svc.store.get(SessionRow, session_id)
    if row is None or row.tenant_id != tenant.tenant_id:
        raise NotFoundError(f"session_id {session_id!r} not found")
    models = svc.store.query(select(ModelRow).where(ModelRow.session_id == session_id))
    samplers = svc.store.query(
        select(SamplingSessionRow).where(SamplingSessionRow.session_id == session_id)
    )
    return GetSessionResponse(
        training_run_ids=[m.model_id for m in models],
        sampler_ids=[s.sampling_session_id for s in samplers],
        user_metadata=row.user_metadata,
        display_name=row.display_name,
    )
