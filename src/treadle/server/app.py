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
from treadle.server.api import errors as api_errors
from treadle.server.api.console import data as console_data
from treadle.server.api.console import pages as console_pages
from treadle.server.api.console.gate import ConsoleGate
from treadle.server.api.middleware import TenantMiddleware
from treadle.server.api.openai import routes as openai_routes
from treadle.server.api.openai.serving import OpenAIServing
from treadle.server.api.tinker import (
    checkpoints,
    futures,
    runs,
    sampling,
    session,
    training,
    treadle,
    weights,
)
from treadle.server.api.tinker.bodies import BodyLimit, limit_by_route
from treadle.server.config import ServerConfig
from treadle.server.core.board import FutureBoard
from treadle.server.core.checkpoints import Checkpoints
from treadle.server.core.console import ConsoleViews
from treadle.server.core.futures import Futures
from treadle.server.core.limits import Admission
from treadle.server.core.metrics import Metrics
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
from treadle.server.registry.bindings import Bindings
from treadle.server.registry.sources import packages_root
from treadle.server.storage.database import Store
from treadle.server.storage.journal import Journal
from treadle.server.tenancy.auth import KeyRing, install_tenant_filter
from treadle.server.tenancy.quotas import QuotaBook
from treadle.server.tenancy.signing import Signer
from treadle.server.tenancy.spend import KeyIdMiddleware, SpendBook

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
        artifacts.remove_leftovers([config.artifacts_dir, root], [root.parent / "cache"])
        store = Store(config.resolved_db_url)
        remove_filter = install_tenant_filter(store.session)
        journal = Journal(store.engine)
        journal.start()
        state = _build_state(config, store, journal, asyncio.get_running_loop())
        recovery = Recovery(state)
        hooks = Hooks(
            on_outcomes=state.futures.finish,
            on_progress=state.futures.progress,
            on_snapshot=recovery.snapshot_written,
            restore=recovery.restore_engine,
            models_of=lambda name: [r.model_id for r in state.models.rows_of(name)],
        )
        workers = Workers(config, hooks, make_engine)
        for handle in workers.handles_for(asyncio.get_running_loop()):
            state.engines.add(handle)
        recovery.load()
        # what tenants and keys spent this day and month, before any engine runs
        await asyncio.to_thread(state.admission.spend.load)
        app.state.console = ConsoleViews(
            config, store, state.engines, state.futures.metrics, state.admission.spend
        )
        state.futures.metrics.start()
        tasks: list[asyncio.Task] = []
        try:
            await workers.start(app.state.stopping)
            state.tokenizer_dirs.update(tokenizer_dirs)
            app.state.server = state
            app.state.keyring = state.keyring
            app.state.openai = OpenAIServing(state)
            _announce_mode(state.keyring)
            tasks.append(asyncio.create_task(_reap_idle_sessions(state)))
            yield
        finally:
            for task in tasks:
                task.cancel()
            await workers.stop()  # first: their last outcomes go to the journal
            await asyncio.to_thread(state.futures.metrics.stop)  # the console's last figures
            journal.stop()
            remove_filter()
            store.close()

    app = FastAPI(title="treadle", lifespan=lifespan)
    app.state.stopping = threading.Event()  # set by a signal: the start-up stops waiting
    app.state.cannot_start = None  # the one line a failed start-up ends with
    # Routes are matched in order, so the ones every call uses come first.
    for module in (futures, training, sampling, session, weights, runs, treadle, checkpoints):
        app.include_router(module.router)
    app.include_router(openai_routes.router)  # /v1: OpenAI-compatible completions
    # the web console (/console) and its JSON (/api/v1/treadle/console), the loop's metrics
    for router in (console_data.metrics_router, console_data.router, console_pages.router):
        app.include_router(router)
    app.state.console_templates = console_pages.make_templates()
    # TreadleError goes through the routing layer's handler (the response is the answer);
    # a bare Exception handler runs in the server-error middleware, which re-raises after.
    app.add_exception_handler(TreadleError, api_errors.handle_error)
    app.add_exception_handler(Exception, api_errors.handle_error)
    app.add_exception_handler(RequestValidationError, api_errors.handle_validation_error)
    app.add_exception_handler(StarletteHTTPException, api_errors.handle_http_error)
    app.add_middleware(BodyLimit, limit_of=limit_by_route(config.limits))
    app.add_middleware(TenantMiddleware)  # runs before any body is read
    app.add_middleware(KeyIdMiddleware)  # the key's id, for per-key spend caps
    app.add_middleware(ConsoleGate)  # outermost: the console's login cookie and static files
    return app


def _build_state(
    config: ServerConfig,
    store: Store,
    journal: Journal,
    loop: asyncio.AbstractEventLoop,
) -> ServerState:
    quotas = QuotaBook(config.quotas, config.tenant_quotas)
    keyring = KeyRing(store.engine, on_quotas=quotas.from_db.__setitem__)
    spend = SpendBook(store.engine, config.prices)
    admission = Admission(config.limits, quotas, config.rate_window_s, spend=spend)
    engines = Engines()
    metrics = Metrics(journal, spend)
    futures_ = Futures(
        journal,
        FutureBoard(loop),
        admission,
        config.long_poll_s,
        durable=config.durable,
        metrics=metrics,
    )
    futures_.after_saves = functools.partial(retain_after, store)
    sessions_ = Sessions(store, journal, admission)
    bindings = Bindings(store, packages_root(config))
    checkpoints_ = Checkpoints(store)
    return ServerState(
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


async def _reap_idle_sessions(state: ServerState) -> None:
    period = min(5.0, state.config.heartbeat_timeout_s / 4)
    while True:
        await asyncio.sleep(period)
        try:
            await state.expire_idle_sessions()
        except Exception:
            log.exception("session reaper")
