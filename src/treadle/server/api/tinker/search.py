"""Searches and a session's own routes: checkpoint search (the newer SDKs'
`RestClient.search_checkpoints`, and the treadle SDK's), session search, moving a session
into a project, and a session's trace (`RestClient.export_session_trace`).

    POST /api/v1/checkpoints/search             filters, cursor → a page, newest first
    POST /api/v1/sessions/search                filters, cursor → a page, newest first
    PUT  /api/v1/sessions/{id}/project          {project_id}
    GET  /api/v1/sessions/{id}/trace_export     → {status: ready, url}: a signed link
    GET  /api/v1/treadle/traces/{token}         the trace (Trace Event Format JSON)
"""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Annotated, Any

from fastapi import APIRouter, Body, Request
from fastapi.responses import JSONResponse
from sqlalchemy import update

from treadle.errors import NotFoundError
from treadle.server.api.deps import StateDep, TenantDep
from treadle.server.api.tinker.runs import checkpoint_view
from treadle.server.core import search, trace_export
from treadle.server.storage.rows import SessionRow
from treadle.server.tenancy.signing import URL_TTL_S
from treadle.wire.sdk_requests import (
    CheckpointSearchCursor,
    CheckpointSearchRequest,
    CheckpointSearchResponse,
    SessionProjectRequest,
    SessionSearchRequest,
)

router = APIRouter(prefix="/api/v1")


@router.post("/checkpoints/search")
def search_checkpoints(
    state: StateDep,
    tenant: TenantDep,
    body: Annotated[CheckpointSearchRequest | None, Body()] = None,
) -> CheckpointSearchResponse:
    """The caller's checkpoints (and, with owner "accessible", those others published),
    newest first, filtered by project, user metadata, type, base model or run (no body:
    the first page of all of them)."""
    body = body or CheckpointSearchRequest()
    rows, cursor = search.checkpoints(state.store, tenant.tenant_id, body)
    next_cursor = None
    if cursor is not None:
        next_cursor = CheckpointSearchCursor(last_time=cursor[0], last_tinker_path=cursor[1])
    return CheckpointSearchResponse(
        checkpoints=[checkpoint_view(r) for r in rows], next_cursor=next_cursor
    )


@router.post("/sessions/search")
def search_sessions(
    state: StateDep,
    tenant: TenantDep,
    body: Annotated[SessionSearchRequest | None, Body()] = None,
) -> dict:
    """The caller's sessions, newest first (SessionSearchResponse)."""
    body = body or SessionSearchRequest()
    found, cursor = search.sessions(state.store, tenant.tenant_id, body)
    next_cursor = None
    if cursor is not None:
        next_cursor = {"last_created_at": cursor[0].isoformat(), "last_session_id": cursor[1]}
    return {"sessions": found, "next_cursor": next_cursor}


def _own_session(state: Any, session_id: str) -> SessionRow:
    row = state.store.get(SessionRow, session_id)  # the tenant filter: another's is None
    if row is None:
        raise NotFoundError(f"session_id {session_id!r} not found")
    return row


@router.put("/sessions/{session_id}/project")
def assign_session_project(
    session_id: str, body: SessionProjectRequest, state: StateDep
) -> dict[str, Any]:
    """Move the session (its runs and samplers with it) into a project: a label the
    tenant groups and searches by, and storage usage is reported by."""
    row = _own_session(state, session_id)
    table = SessionRow.__table__
    with state.store.engine.begin() as conn:
        conn.execute(
            update(table)
            .where(table.c.session_id == row.session_id)
            .values(project_id=body.project_id)
        )
    return {"session_id": session_id, "project_id": body.project_id}


@router.get("/sessions/{session_id}/trace_export")
def export_session_trace(
    session_id: str, state: StateDep, tenant: TenantDep, request: Request
) -> dict[str, Any]:
    """→ {status: "ready", url}: a signed link (valid URL_TTL_S, no key needed) to the
    session's timeline, built when it is fetched."""
    _own_session(state, session_id)
    expires = int(dt.datetime.now(dt.UTC).timestamp()) + URL_TTL_S
    token = state.signer.sign({"trace": session_id, "tenant": tenant.tenant_id, "exp": expires})
    base = str(request.base_url).rstrip("/")
    return {"status": "ready", "url": f"{base}/api/v1/treadle/traces/{token}"}


@router.get("/treadle/traces/{token}")
async def download_trace(token: str, state: StateDep) -> JSONResponse:
    """A session's trace, by its signed link (the signature is the grant)."""
    claims = state.signer.verify(token, "trace")
    body = await asyncio.to_thread(
        trace_export.trace, state.store, claims["tenant"], claims["trace"]
    )
    name = f"{claims['trace']}.json"
    return JSONResponse(body, headers={"Content-Disposition": f'attachment; filename="{name}"'})
