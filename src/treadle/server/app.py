"""The FastAPI app factory: settings, database, engines and every component are built in
the lifespan, never at import, and torn down with it.

A server that cannot serve a model stops at start with one line saying why (CannotStart,
kept in `app.state.cannot_start` for `treadle serve` to print: treadle.server.main); a
signal while it starts (`app.state.stopping`) ends the start-up at once.

    treadle serve --model treadle/tiny-llama=.models/tiny-llama
    treadle serve --model ... --db postgresql://db-host/treadle
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from treadle.artifacts import folders as artifacts
from treadle.errors import TreadleError
from treadle.protocol import tracing
from treadle.server.api import errors as api_errors
from treadle.server.api import metrics as metrics_route
from treadle.server.api.anthropic import routes as anthropic_routes
from treadle.server.api.capture import routes as capture_routes
from treadle.server.api.middleware import KeyIdMiddleware, TenantMiddleware
from treadle.server.api.openai import routes as openai_routes
from treadle.server.api.openai.serving import OpenAIServing
from treadle.server.api.tinker import (
    account,
    checkpoints,
    copies,
    futures,
    runs,
    sampling,
    search,
    session,
    training,
    treadle,
    weights,
)
from treadle.server.api.tinker.bodies import BodyLimit, limit_by_route
from treadle.server.config import ServerConfig
from treadle.server.console.wiring import Console, add_console, metrics_router
from treadle.server.core import lifetime, uploads
from treadle.server.core.board import FutureBoard
from treadle.server.core.checkpoints import Checkpoints
from treadle.server.core.completions import Completions
from treadle.server.core.custom_losses import CustomLosses
from treadle.server.core.futures import Futures
from treadle.server.core.limits import Admission
from treadle.server.core.listeners import OutcomeListener
from treadle.server.core.models import TrainingModels
from treadle.server.core.recovery import Recovery
from treadle.server.core.samplers import Samplers
from treadle.server.core.saves import retain_after
from treadle.server.core.sessions import Sessions
from treadle.server.core.state import ServerState
from treadle.server.engines.served import Engines
from treadle.server.engines.startup import CannotStart, check_models
from treadle.server.engines.threads import EngineFactory, default_engine_factory
from treadle.server.engines.workers import Hooks, Workers
from treadle.server.observe.http import ObserveRequests
from treadle.server.observe.listener import MetricsListener
from treadle.server.observe.metrics import LIVE
from treadle.server.observe.tracing import RequestTracing
from treadle.server.registry.bindings import Bindings
from treadle.server.registry.sources import packages_root
from treadle.server.storage.database import Store
from treadle.server.storage.journal import Journal
from treadle.server.tenancy.auth import KeyRing, install_tenant_filter
from treadle.server.tenancy.quotas import QuotaBook
from treadle.server.tenancy.signing import Signer
from treadle.server.tenancy.spend import SpendBook
from treadle.server.tenancy.spend_listener import SpendListener
from treadle.server.tenancy.tokens import TokenIssuer

log = logging.getLogger("treadle.server")


def create_app(config: ServerConfig, engine_factory: EngineFactory | None = None) -> FastAPI:
    """The app; `engine_factory` makes the Engine of each worker thread when engines run in
    this process (engine_processes false: tests plant faults through it)."""
    make_engine = engine_factory or default_engine_factory

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            async with _serving(app) as started:
                yield started
        except CannotStart as e:
            app.state.cannot_start = str(e)
            raise

    @contextlib.asynccontextmanager
    async def _serving(app: FastAPI) -> AsyncIterator[None]:
        Path(config.data_dir).mkdir(parents=True, exist_ok=True)
        # before anything starts: each model's path, architecture and tokenizer
        tokenizer_dirs = await asyncio.to_thread(check_models, config)
        root = packages_root(config)
        # the state folder too: a snapshot's folders are written beside their names, then renamed
        leftovers = [config.artifacts_dir, config.state_dir, root]
        artifacts.remove_leftovers(leftovers, [root.parent / "cache"])
        store = Store(config.resolved_db_url)
        remove_filter = install_tenant_filter(store.session)
        journal = Journal(store.engine)
        journal.start()
        spend = SpendBook(store.engine, config.prices)
        spend_listener = SpendListener(spend)  # every op is charged, console or not
        listeners: list[OutcomeListener] = [
            spend_listener,
            MetricsListener(config.metrics_max_tenants),
        ]
        # traces: off (and free) unless an OTLP endpoint is configured
        traced = tracing.setup(tracing.endpoint_of(config.otel_endpoint), "treadle-api")
        request_tracing = RequestTracing(tracing.tracer()) if traced is not None else None
        if request_tracing is not None:
            listeners.append(request_tracing)
        console = Console(config, journal) if config.console else None
        if console is not None:
            listeners.append(console.recorder)
        # what tenants and keys spent this day and month, and whom the ops a previous run
        # left unfinished are charged to: before recovery finishes any, before engines run
        await asyncio.to_thread(spend_listener.load)
        loop = asyncio.get_running_loop()
        state = _build_state(config, store, journal, loop, spend, listeners)
        state.futures.tracing = request_tracing
        LIVE.read = functools.partial(metrics_route.live_figures, state)  # read at each scrape
        recovery = Recovery(state)
        hooks = Hooks(
            on_outcomes=state.futures.finish,
            on_progress=state.futures.progress,
            on_snapshot=recovery.snapshot_written,
            restore=recovery.restore_engine,
            models_of=lambda name: [r.model_id for r in state.models.rows_of(name)],
        )
        workers = Workers(config, hooks, make_engine)
        for handle in workers.handles_for(loop):
            state.engines.add(handle)
        recovery.load()
        if console is not None:
            console.start(app, store, state.engines, spend)
        tasks: list[asyncio.Task] = []
        try:
            await workers.start(app.state.stopping)
            state.tokenizer_dirs.update(tokenizer_dirs)
            app.state.server = state
            app.state.keyring = state.keyring
            app.state.openai = OpenAIServing(state)
            _announce_mode(state.keyring)
            tasks.append(asyncio.create_task(_reap_idle_sessions(state)))
            tasks.append(asyncio.create_task(_expire_checkpoints(state)))
            yield
        finally:
            for task in tasks:
                task.cancel()
            await workers.stop()  # first: their last outcomes go to the journal
            if console is not None:
                await asyncio.to_thread(console.stop)  # the console's last figures
            journal.stop()
            remove_filter()
            store.close()
            LIVE.read = None
            if traced is not None:
                await asyncio.to_thread(tracing.shutdown)  # the last spans

    app = FastAPI(title="treadle", lifespan=lifespan)
    app.state.stopping = threading.Event()  # set by a signal: the start-up stops waiting
    app.state.cannot_start = None  # the one line a failed start-up ends with
    # Routes are matched in order, so the ones every call uses come first.
    for module in (futures, training, sampling, session, weights, runs, treadle, checkpoints):
        app.include_router(module.router)
    for module in (search, copies, account):  # the rest of the SDK's surface
        app.include_router(module.router)
    app.include_router(openai_routes.router)  # /v1: OpenAI-compatible completions
    app.include_router(anthropic_routes.router)  # /v1/messages: Anthropic's Messages API
    app.include_router(capture_routes.router)  # capture sessions (the SDK's side)
    app.include_router(metrics_router)  # the loop's own metrics (log_metrics), console or not
    app.include_router(metrics_route.router)  # GET /metrics: Prometheus (operators)
    # TreadleError goes through the routing layer's handler (the response is the answer);
    # a bare Exception handler runs in the server-error middleware, which re-raises after.
    app.add_exception_handler(TreadleError, api_errors.handle_error)
    app.add_exception_handler(Exception, api_errors.handle_error)
    app.add_exception_handler(RequestValidationError, api_errors.handle_validation_error)
    app.add_exception_handler(StarletteHTTPException, api_errors.handle_http_error)
    app.add_middleware(BodyLimit, limit_of=limit_by_route(config.limits))
    app.add_middleware(TenantMiddleware)  # runs before any body is read
    app.add_middleware(KeyIdMiddleware)  # the key's id, for per-key spend caps
    if config.console:  # the web console (/console) and its JSON (/api/v1/treadle/console)
        add_console(app)  # its gate outside the API's: the login cookie and static files
    app.add_middleware(ObserveRequests)  # outermost: counts (and traces) every answer
    return app


def _build_state(
    config: ServerConfig,
    store: Store,
    journal: Journal,
    loop: asyncio.AbstractEventLoop,
    spend: SpendBook,
    listeners: list[OutcomeListener],
) -> ServerState:
    quotas = QuotaBook(config.quotas, config.tenant_quotas)
    keyring = KeyRing(
        store.engine, on_quotas=quotas.from_db.__setitem__, ttl_s=config.auth_cache_ttl_s
    )
    keyring.tokens = TokenIssuer(config.jwt_ttl_s)
    admission = Admission(config.limits, quotas, config.rate_window_s, spend=spend)
    engines = Engines()
    completions = Completions(loop, config.long_poll_s)  # retrieve_futures
    listeners = [*listeners, completions]
    futures_ = Futures(
        journal,
        FutureBoard(loop),
        admission,
        config.long_poll_s,
        listeners=listeners,
        durable=config.durable,
    )
    futures_.after_saves = functools.partial(retain_after, store)
    sessions_ = Sessions(store, journal, admission)
    bindings = Bindings(store, packages_root(config))
    checkpoints_ = Checkpoints(store)
    return ServerState(
        custom_losses=CustomLosses(store, journal, sessions_, futures_),
        completions=completions,
        config=config,
        store=store,
        journal=journal,
        engines=engines,
        admission=admission,
        futures=futures_,
        sessions=sessions_,
        models=TrainingModels(store, journal, sessions_, engines, admission, futures_, bindings),
        samplers=Samplers(store, journal, sessions_, engines, checkpoints_),
        checkpoints=checkpoints_,
        bindings=bindings,
        keyring=keyring,
        signer=Signer(),
    )


def _announce_mode(keyring: KeyRing) -> None:
    if keyring.dev_mode:
        log.warning(
            "no tenants in the database: single-user development mode, API keys are not "
            "checked (create one with `treadle admin create-tenant NAME`)"
        )
    else:
        log.info("tenants configured: every request needs an API key")


async def _expire_checkpoints(state: ServerState) -> None:
    """Checkpoints past their TTL: their files deleted (treadle.server.core.lifetime)."""
    while True:
        await asyncio.sleep(state.config.checkpoint_sweep_s)
        try:
            await asyncio.to_thread(lifetime.expire_due, state.store)
            await asyncio.to_thread(uploads.sweep, state)
        except Exception:
            log.exception("checkpoint expiry")


async def _reap_idle_sessions(state: ServerState) -> None:
    period = min(5.0, state.config.heartbeat_timeout_s / 4)
    while True:
        await asyncio.sleep(period)
        try:
            await state.expire_idle_sessions()
        except Exception:
            log.exception("session reaper")
