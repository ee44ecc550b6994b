"""Client bootstrap, sessions, health and stubs the Tinker SDK calls."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body
from fastapi.responses import JSONResponse

from treadle.errors import NotFoundError, SessionGoneError
from treadle.server.api.deps import StateDep, TenantDep
from treadle.server.api.tinker.runs import Limit, Offset
from treadle.server.storage import queries
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


@router.get("/healthz", response_model=HealthResponse)
async def healthz(state: StateDep) -> Any:
    """Answered once every model is loaded (the lifespan loads them before serving); 503
    naming the models given up since (their workers cannot load them), while any is."""
    down = {
        engine.name: r.reason
        for engine in state.engines.all()
        for r in engine.status()
        if r.reason is not None
    }
    if down:
        return JSONResponse({"status": "down", "models_down": down}, status_code=503)
    return HealthResponse()


@router.post("/client/config")
async def client_config(state: StateDep, body: OptionalJson = None) -> ClientConfigResponse:
    """The SDK's optional protocols this server speaks: custom losses run here, samplers
    poll their futures together and clones join their session (batch_polling), the token
    exchange when jwt_auth is on."""
    config = state.config
    return ClientConfigResponse(
        pjwt_auth_enabled=config.jwt_auth,
        custom_loss_server_side=True,
        sample_use_retrieve_futures=config.batch_polling,
        sample_join_sampling_session=config.batch_polling,
    )


@router.post("/client/dynamic_config")
async def client_dynamic_config(
    body: OptionalJson = None,
) -> ClientDynamicConfigResponse:
    """The SDK cancels the sample requests it abandons (cancel_future)."""
    return ClientDynamicConfigResponse(sample_cancel_enabled=True)


@router.get("/get_server_capabilities")
async def get_server_capabilities(state: StateDep) -> GetServerCapabilitiesResponse:
    models = [
        SupportedModel(model_name=e.name, max_context_length=e.facts.max_seq_len)
        for e in state.engines.all()
    ]
    return GetServerCapabilitiesResponse(supported_models=models)


@router.post("/create_session")
async def create_session(
    body: CreateSessionRequest, state: StateDep, tenant: TenantDep
) -> CreateSessionResponse:
    sid = await state.sessions.create(
        tenant,
        body.tags,
        body.user_metadata,
        body.display_name,
        body.sdk_version,
        project_id=body.project_id,
    )
    return CreateSessionResponse(session_id=sid)


@router.post("/session_heartbeat")
async def session_heartbeat(
    body: SessionHeartbeatRequest, state: StateDep
) -> SessionHeartbeatResponse:
    state.sessions.require(body.session_id)
    return SessionHeartbeatResponse()


@router.post("/sessions/{session_id}/finish")
async def finish_session(
    session_id: str, state: StateDep, body: Annotated[SessionFinishRequest | None, Body()] = None
) -> dict[str, Any]:
    """close(): idempotent; a session already ended answers {} too."""
    try:
        state.sessions.require(session_id)
    except SessionGoneError:
        return {}
    await state.end_session(session_id, "finished")
    return {}


@router.post("/telemetry")
async def telemetry(body: OptionalJson = None) -> TelemetryResponse:
    return TelemetryResponse()


@router.get("/sessions")
def list_sessions(
    state: StateDep, tenant: TenantDep, limit: Limit = 20, offset: Offset = 0
) -> ListSessionsResponse:
    with state.store.engine.connect() as conn:
        ids = queries.session_ids(conn, tenant.tenant_id, limit, offset)
    return ListSessionsResponse(sessions=ids)


@router.get("/sessions/{session_id}")
def get_session(session_id: str, state: StateDep, tenant: TenantDep) -> GetSessionResponse:
    with state.store.engine.connect() as conn:
        found = queries.session_detail(conn, tenant.tenant_id, session_id)
    if found is None:
        raise NotFoundError(f"session_id {session_id!r} not found")
    row, model_ids, sampler_ids = found
    metadata = row["user_metadata"]  # strings, checked on the way in (older rows: any JSON)
    return GetSessionResponse(
        training_run_ids=model_ids,
        sampler_ids=sampler_ids,
        user_metadata=None if metadata is None else {k: str(v) for k, v in metadata.items()},
        display_name=row["display_name"],
    )
