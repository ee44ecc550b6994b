"""The FastAPI app factory: settings, database, engines and the engine loops are built in
the lifespan, never at import.

    treadle serve --model treadle/tiny-llama=.models/tiny-llama
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from treadle.errors import (
    ConflictError,
    EngineDeadError,
    InvalidRequestError,
    NotFoundError,
    QuotaExceededError,
    TreadleError,
)
from treadle.server.auth import TenantMiddleware, start_auth
from treadle.server.config import ServerConfig
from treadle.server.db import SessionRow, Store
from treadle.server.journal import Journal
from treadle.server.notifier import FutureBoard
from treadle.server.openai import errors as openai_errors
from treadle.server.openai import routes as openai_routes
from treadle.server.routes import (
    checkpoints,
    futures,
    sampling,
    session,
    training,
    treadle,
    weights,
)
from treadle.server.service import Service, SessionGoneError

log = logging.getLogger("treadle.server")

EngineFactory = Callable[[str, str, ServerConfig], Any]  # (name, folder, config) → Engine

# Most specific first: SessionGoneError is a NotFoundError answered with 410.
STATUS_OF_ERROR: list[tuple[type[Exception], int, str]] = [
    (SessionGoneError, 410, "user"),
    (InvalidRequestError, 400, "user"),
    (NotFoundError, 404, "user"),
    (ConflictError, 409, "user"),
    (QuotaExceededError, 429, "user"),
    (EngineDeadError, 503, "server"),
]


def default_engine_factory(name: str, model_dir: str, config: ServerConfig) -> Any:
    from treadle.engine.engine import Engine

    return Engine(model_dir, dtype=config.dtype, device=config.device, model_name=name)


def create_app(config: ServerConfig, engine_factory: EngineFactory | None = None) -> FastAPI:
    make_engine = engine_factory or default_engine_factory

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        Path(config.data_dir).mkdir(parents=True, exist_ok=True)
        store = Store(config.resolved_db_url)
        failed = store.fail_unfinished("the server restarted before this request finished")
        if failed:
            log.warning("marked %d unfinished requests of a previous run as failed", failed)
        _expire_sessions_of_previous_run(store)
        journal = Journal(store.engine)
        journal.start()
        service = Service(config, store, journal, FutureBoard(asyncio.get_running_loop()))
        try:
            for name, path in config.models.items():
                log.info("loading model %s from %s", name, path)
                service.add_engine(name, await asyncio.to_thread(make_engine, name, path, config))
            app.state.service = service
            start_auth(app, service)  # keys → tenants (treadle.server.auth)
            reaper = asyncio.create_task(_reap_idle_sessions(service))
            try:
                yield
            finally:
                reaper.cancel()
        finally:
            service.stop()  # the engine threads first: their last outcomes go to the journal
            journal.stop()
            store.close()

    app = FastAPI(title="treadle", lifespan=lifespan)
    # Routes are matched in order, so the ones every call uses come first.
    for router_module in (futures, training, sampling, session, weights, treadle, checkpoints):
        app.include_router(router_module.router)
    app.include_router(openai_routes.router)  # /v1: OpenAI-compatible completions
    # TreadleError goes through the routing layer's handler (the response is the answer);
    # a bare Exception handler runs in the server-error middleware, which re-raises after.
    app.add_exception_handler(TreadleError, _handle_error)
    app.add_exception_handler(Exception, _handle_error)
    app.add_exception_handler(RequestValidationError, _handle_validation_error)
    app.add_exception_handler(StarletteHTTPException, _handle_http_error)
    app.add_middleware(TenantMiddleware)
    return app


def _expire_sessions_of_previous_run(store: Store) -> None:
    from sqlalchemy import update

    with store.session.begin() as s:
        s.execute(update(SessionRow).where(SessionRow.status == "active").values(status="expired"))


async def _reap_idle_sessions(service: Service) -> None:
    period = min(5.0, service.config.heartbeat_timeout_s / 4)
    while True:
        await asyncio.sleep(period)
        try:
            await service.expire_idle_sessions()
        except Exception:
            log.exception("session reaper")


async def _handle_error(request: Request, exc: Exception) -> JSONResponse:
    """The one place errors become HTTP: always a JSON body naming the problem (the tinker
    SDK takes a 400 with an empty body for a proxy reset and retries it)."""
    for cls, status, category in STATUS_OF_ERROR:
        if isinstance(exc, cls):
            response = _error_response(request, str(exc), category, status)
            response.headers.update(getattr(exc, "http_headers", {}))  # a quota's Retry-After
            return response
    if not isinstance(exc, TreadleError):
        log.error("unhandled error on %s", request.url.path, exc_info=exc)
    message = f"internal server error: {type(exc).__name__}: {exc}"
    return _error_response(request, message, "server", 500)


def _error_response(request: Request, message: str, category: str, status: int) -> JSONResponse:
    """Our error body; OpenAI's shape on its /v1 paths, so that its clients parse it."""
    if openai_errors.is_openai_path(request.url.path):
        return openai_errors.error_response(message, status)
    return JSONResponse({"error": message, "category": category}, status_code=status)


async def _handle_http_error(request: Request, exc: StarletteHTTPException) -> Response:
    """Routing's own errors (unknown route, wrong method) in our shapes, not FastAPI's."""
    if exc.status_code in (204, 304):
        return Response(status_code=exc.status_code, headers=exc.headers)
    message = f"{request.method} {request.url.path}: {exc.detail}"
    response = _error_response(request, message, "user", exc.status_code)
    response.headers.update(exc.headers or {})
    return response


async def _handle_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    problems = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        problems.append(f"{loc or 'body'}: {err.get('msg')}")
    if openai_errors.is_openai_path(request.url.path):
        return openai_errors.validation_error_response(exc.errors(), problems)
    return JSONResponse(
        {"error": "invalid request: " + "; ".join(problems), "category": "user"}, status_code=400
    )
