"""The console's JSON endpoints, under /api/v1/treadle/console/ (what its pages poll; scripts
may call them with an API key like any other route), and the loop's own metrics,
POST /api/v1/treadle/metrics (TrainingClient.log_metrics).

    GET overview                      served models, engine figures, requests, errors
    GET sessions?q=&status=&sort=&desc=&limit=   the sessions table
    GET sessions/{id}                 one session: models, usage and cost, checkpoints
    GET sessions/{id}/metrics?since_step=        its curves, per step
    GET sessions/{id}/timeline?limit=            its ops: wait, run, p50/p90/p99 per kind
    GET sessions/{id}/trace           the timeline as Chrome / Perfetto trace JSON
    GET checkpoints                   model package groups, versions, checkpoints
    GET usage?by=&since=              usage and cost, per day, and the spend caps

A tenant's key sees its own tenant; an admin key (or development mode) sees every tenant,
or one with ?tenant=NAME.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from treadle.errors import InvalidRequestError, NotFoundError
from treadle.server.api.deps import StateDep
from treadle.server.console.deps import ViewerDep, ViewsDep
from treadle.server.console.figures import check_user_metrics, log_user
from treadle.server.tenancy import metering
from treadle.server.tenancy.auth import owns

router = APIRouter(prefix="/api/v1/treadle/console")
metrics_router = APIRouter(prefix="/api/v1/treadle")


@router.get("/overview")
def overview(views: ViewsDep, viewer: ViewerDep, tenant: str | None = None) -> dict[str, Any]:
    """Served models and their engines, sessions, requests per minute and errors."""
    return {**views.overview(viewer.scope(views, tenant)), "viewer": _viewer(viewer)}


@router.get("/sessions")
def list_sessions(
    views: ViewsDep,
    viewer: ViewerDep,
    q: str | None = None,
    status: str | None = None,
    sort: str = "created",
    desc: bool = True,
    limit: int = Query(200, ge=1, le=500),
    tenant: str | None = None,
) -> dict[str, Any]:
    """The sessions table: filtered by `q` (any column) and `status`, sorted by `sort`."""
    try:
        return views.sessions(viewer.scope(views, tenant), q, status, sort, desc, limit)
    except ValueError as e:
        raise InvalidRequestError(str(e)) from e


@router.get("/sessions/{session_id}")
def get_session(session_id: str, views: ViewsDep, viewer: ViewerDep) -> dict[str, Any]:
    return views.session(viewer.scope(views), session_id)


@router.get("/sessions/{session_id}/metrics")
def get_curves(
    session_id: str, views: ViewsDep, viewer: ViewerDep, since_step: int = Query(0, ge=0, le=2**62)
) -> dict[str, Any]:
    """The session's curves from `since_step` on: the server's per-step figures
    (server/loss, server/grad_norm, ...) and the loop's own (log_metrics)."""
    return views.curves(viewer.scope(views), session_id, since_step)


@router.get("/sessions/{session_id}/timeline")
def get_timeline(
    session_id: str,
    views: ViewsDep,
    viewer: ViewerDep,
    limit: int = Query(300, ge=1, le=5000),
) -> dict[str, Any]:
    return views.timeline(viewer.scope(views), session_id, limit)


@router.get("/sessions/{session_id}/trace")
def get_trace(session_id: str, views: ViewsDep, viewer: ViewerDep) -> JSONResponse:
    """The session's ops as a Chrome trace (open it in ui.perfetto.dev or chrome://tracing)."""
    trace = views.trace(viewer.scope(views), session_id)
    disposition = f'attachment; filename="treadle-{session_id}-trace.json"'
    return JSONResponse(trace, headers={"Content-Disposition": disposition})


@router.get("/checkpoints")
def list_checkpoints(views: ViewsDep, viewer: ViewerDep, tenant: str | None = None) -> dict:
    return views.checkpoints(viewer.scope(views, tenant))


@router.get("/usage")
def get_usage(
    views: ViewsDep,
    viewer: ViewerDep,
    by: str | None = None,
    since: str | None = None,
    tenant: str | None = None,
) -> dict[str, Any]:
    """The usage report (as GET /api/v1/treadle/usage), its days, and the spend caps."""
    when = metering.usage_query(since, by)
    return views.usage(viewer.scope(views, tenant), by, when)


class LogMetricsRequest(BaseModel):
    model_id: str
    step: Any
    """The loop's step (an integer >= 0); a later report of the same step replaces its values."""
    metrics: dict[str, Any]
    """name → number; non-finite numbers are skipped (and named in the reply)."""


@metrics_router.post("/metrics")
async def log_metrics(body: LogMetricsRequest, state: StateDep) -> dict:
    """A training loop's own metrics of one step, shown beside the server's in the console
    (kept with the console off too: the loop's call still works)."""
    row = await asyncio.to_thread(state.models.row, body.model_id)
    if row is None or not owns(row.tenant_id):
        raise NotFoundError(f"model_id: model {body.model_id!r} not found")
    try:
        step, values, skipped = check_user_metrics(body.step, body.metrics)
    except ValueError as e:
        raise InvalidRequestError(str(e)) from e
    await log_user(state.journal, row.tenant_id, row.session_id, row.model_id, step, values)
    return {"recorded": len(values), "skipped": skipped}


def _viewer(viewer: Any) -> dict[str, Any]:
    return {"tenant": viewer.tenant.name, "admin": viewer.admin, "dev_mode": viewer.dev_mode}
