"""The console's pages: server-rendered from the same read model as the JSON endpoints
(treadle.server.console.views). Each page's live part re-fetches itself every few seconds
(htmx: hx-get the page, hx-select the part); its charts poll the JSON endpoints
(static/console.js with uPlot).

    /console                 overview          /console/sessions            sessions
    /console/sessions/{id}   one session       /console/checkpoints         checkpoints
    /console/usage           usage and cost    /console/download/{ref}      a version's tar
    /console/playground      chat with a base model, a live training model or a checkpoint
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, Response
from fastapi.templating import Jinja2Templates

from treadle.errors import InvalidRequestError, NotFoundError, TreadleError
from treadle.server.api.deps import KeyDep, StateDep
from treadle.server.api.openai.resolve import list_models
from treadle.server.api.tinker import checkpoints as checkpoint_routes
from treadle.server.console import timeline
from treadle.server.console.deps import Viewer, ViewerDep, ViewsDep
from treadle.server.console.views import SESSION_SORTS
from treadle.server.tenancy import metering
from treadle.server.tenancy.auth import Tenant, reset_current_tenant, set_current_tenant

router = APIRouter(prefix="/console")
HERE = Path(__file__).parent
LIVE_EVERY_S = 2  # how often a page's live part refreshes


def make_templates() -> Jinja2Templates:
    templates = Jinja2Templates(directory=str(HERE / "templates"))
    templates.env.filters.update(
        bytes=fmt_bytes, usd=fmt_usd, when=fmt_when, num=fmt_num, ms=fmt_ms
    )
    templates.env.globals.update(
        live_every_s=LIVE_EVERY_S, model_label=timeline.model_label, urlencode=urlencode
    )
    return templates


def render(
    request: Request, viewer: Viewer, name: str, status_code: int = 200, **context: Any
) -> HTMLResponse:
    templates: Jinja2Templates = request.app.state.console_templates
    query = dict(request.query_params)
    query.pop("part", None)  # which live part an htmx refresh asks for (see _live.html)
    if not viewer.admin:
        query.pop("tenant", None)  # means nothing to a tenant's own view
    context = {
        "viewer": viewer,
        "path": request.url.path,
        "query": query,
        "status_code": status_code,
        **context,
    }
    return templates.TemplateResponse(request, name, context, status_code=status_code)


def error_page(request: Request, viewer: Viewer, error: TreadleError) -> HTMLResponse:
    return render(request, viewer, "error.html", error.status, message=str(error))


@router.get("", response_class=HTMLResponse)
def overview_page(request: Request, views: ViewsDep, viewer: ViewerDep) -> HTMLResponse:
    """Served models, engine workers, sessions, requests per minute, errors."""
    tenant = request.query_params.get("tenant")
    return render(
        request, viewer, "overview.html", view=views.overview(viewer.scope(views, tenant))
    )


@router.get("/sessions", response_class=HTMLResponse)
def sessions_page(
    request: Request,
    views: ViewsDep,
    viewer: ViewerDep,
    q: str | None = None,
    status: str | None = None,
    sort: str = "created",
    desc: bool = True,
    tenant: str | None = None,
) -> HTMLResponse:
    """Every session, sortable and filterable."""
    if sort not in SESSION_SORTS:
        sort = "created"
    view = views.sessions(viewer.scope(views, tenant), q, status or None, sort, desc)
    return render(request, viewer, "sessions.html", view=view)


@router.get("/sessions/{session_id}", response_class=HTMLResponse)
def session_page(
    session_id: str, request: Request, views: ViewsDep, viewer: ViewerDep
) -> HTMLResponse:
    """One session: its curves, checkpoints, cost so far and request timeline."""
    part = request.query_params.get("part")  # a refresh of the cards needs no timeline
    try:
        session = views.session(viewer.scope(views), session_id)
        line = views.timeline(viewer.scope(views), session_id) if part != "live" else None
    except NotFoundError as e:
        return error_page(request, viewer, e)
    bars = timeline.svg_bars(line["ops"]) if line else None
    return render(request, viewer, "session.html", s=session, line=line, bars=bars)


@router.get("/checkpoints", response_class=HTMLResponse)
def checkpoints_page(
    request: Request, views: ViewsDep, viewer: ViewerDep, tenant: str | None = None
) -> HTMLResponse:
    """Model package groups, their versions and retention, and tinker:// checkpoints."""
    return render(
        request, viewer, "checkpoints.html", view=views.checkpoints(viewer.scope(views, tenant))
    )


@router.get("/usage", response_class=HTMLResponse)
def usage_page(
    request: Request,
    views: ViewsDep,
    viewer: ViewerDep,
    by: str | None = None,
    since: str | None = None,
    tenant: str | None = None,
) -> HTMLResponse:
    """Usage and cost per tenant, session, model and day; spend caps."""
    try:
        when = metering.usage_query(since, by)
    except InvalidRequestError as e:
        return error_page(request, viewer, e)
    view = views.usage(viewer.scope(views, tenant), by or None, when)
    return render(request, viewer, "usage.html", view=view, groupings=metering.GROUPINGS)


@router.get("/playground", response_class=HTMLResponse)
async def playground_page(request: Request, state: StateDep, viewer: ViewerDep) -> HTMLResponse:
    """Chat with what the viewer's key may sample: the served base models, its tenant's live
    training models and its sampler checkpoints (the list GET /v1/models gives that key).
    The page calls POST /v1/chat/completions itself, metered like any client's call."""
    models = await list_models(state, viewer.tenant.tenant_id)
    groups: dict[str, list[dict[str, Any]]] = {"base": [], "live": [], "checkpoint": []}
    for m in models:
        kind = "base" if m["owned_by"] == "treadle" else "checkpoint"
        if kind == "checkpoint" and not m["id"].startswith("tinker://"):
            kind = "live"
        groups[kind].append(m)
    return render(request, viewer, "playground.html", groups=groups)


@router.get("/download/{ref}")
async def download_version(
    ref: str,
    request: Request,
    state: StateDep,
    viewer: ViewerDep,
    key: KeyDep,
    tenant_id: str | None = None,
) -> Response:
    """A version's files as a tar (the checkpoint API's archive); an admin may name the
    version's tenant with ?tenant_id=."""
    owner = viewer.tenant
    if viewer.admin and tenant_id:
        owner = Tenant(tenant_id=tenant_id, name=tenant_id)
    token = set_current_tenant(owner)  # the registry's reads are scoped by the request's tenant
    try:
        return await checkpoint_routes.version_archive(ref, state, owner, key)
    except TreadleError as e:
        return error_page(request, viewer, e)
    finally:
        reset_current_tenant(token)


# ---- formatting (template filters) ----
def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1024 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def fmt_usd(x: float | None) -> str:
    if x is None:
        return "-"
    return f"${x:,.2f}" if abs(x) >= 1 else f"${x:.6f}".rstrip("0").rstrip(".") if x else "$0"


def fmt_when(iso: str | None) -> str:
    if not iso:
        return "-"
    try:
        when = dt.datetime.fromisoformat(iso)
    except ValueError:
        return iso
    return when.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


def fmt_num(x: Any, digits: int = 4) -> str:
    if x is None:
        return "-"
    if isinstance(x, int):
        return f"{x:,}"
    return f"{x:.{digits}g}"


def fmt_ms(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.1f} ms" if x < 1000 else f"{x / 1000:.2f} s"
