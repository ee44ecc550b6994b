"""The FastAPI app factory: settings, database, engines and every component are built in
the lifespan, never at import, and torn down with it.

    treadle serve --model treadle/tiny-llama=.models/tiny-llama
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from sqlalchemy import update
from starlette.exceptions import HTTPException as StarletteHTTPException

from treadle.errors import TreadleError
from treadle.server.api import errors as api_errors
from treadle.server.api.console import data as console_data
from treadle.server.api.console import pages as console_pages
from treadle.server.api.console.gate import ConsoleGate
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
from treadle.server.config import ServerConfig
from treadle.server.core.board import FutureBoard
from treadle.server.core.checkpoints import Checkpoints
from treadle.server.core.console import ConsoleViews
from treadle.server.core.engines import Engines
from treadle.server.core.futures import Futures
from treadle.server.core.limits import Admission
from treadle.server.core.metrics import Metrics
from treadle.server.core.models import TrainingModels
from treadle.server.core.samplers import Samplers
from treadle.server.core.sessions import Sessions
from treadle.server.core.state import ServerState
from treadle.server.registry.bindings import Bindings
from treadle.server.registry.sources import packages_root
from treadle.server.runtime.checkpoint_writer import CheckpointWriter
from treadle.server.runtime.engine_client import EngineFacts
from treadle.server.runtime.engine_loop import EngineLoop
from treadle.server.runtime.executor import OpExecutor
from treadle.server.runtime.journal import Journal
from treadle.server.storage.database import Store
from treadle.server.storage.rows import SessionRow
from treadle.server.tenancy.auth import KeyRing, TenantMiddleware, install_tenant_filter
from treadle.server.tenancy.quotas import QuotaBook
from treadle.server.tenancy.signing import Signer
from treadle.server.tenancy.spend import KeyIdMiddleware, SpendBook

log = logging.getLogger("treadle.server")

EngineFactory = Callable[[str, str, ServerConfig], Any]  # (name, folder, config) → Engine


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
        remove_filter = install_tenant_filter(store.session)
        journal = Journal(store.engine)
        journal.start()
        state = _build_state(config, store, journal, asyncio.get_running_loop())
        # what tenants and keys spent this day and month, before any engine runs
        await asyncio.to_thread(state.admission.spend.load)
        app.state.console = ConsoleViews(
            config, store, state.engines, state.futures.metrics, state.admission.spend
        )
        state.futures.metrics.start()
        try:
            for name, path in config.models.items():
                log.info("loading model %s from %s", name, path)
                engine = await asyncio.to_thread(make_engine, name, path, config)
                state.engines.add(_engine_loop(name, engine, state, config))
            for engine in state.engines.all():
                engine.start()
            app.state.server = state
            app.state.keyring = state.keyring
            app.state.openai = OpenAIServing(state)
            _announce_mode(state.keyring)
            reaper = asyncio.create_task(_reap_idle_sessions(state))
            try:
                yield
            finally:
                reaper.cancel()
        finally:
            for engine in state.engines.all():  # first: their last outcomes go to the journal
                engine.stop()
            await asyncio.to_thread(state.futures.metrics.stop)  # the console's last figures
            journal.stop()
            remove_filter()
            store.close()

    app = FastAPI(title="treadle", lifespan=lifespan)
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
    app.add_middleware(TenantMiddleware)
    app.add_middleware(KeyIdMiddleware)  # the key's id, for per-key spend caps
    app.add_middleware(ConsoleGate)  # outermost: the console's login cookie and static files
    return app


def _build_state(
    config: ServerConfig, store: Store, journal: Journal, loop: asyncio.AbstractEventLoop
) -> ServerState:
    quotas = QuotaBook(config.quotas, config.tenant_quotas)
    keyring = KeyRing(store.engine, on_quotas=quotas.from_db.__setitem__)
    spend = SpendBook(store.engine, config.prices)
    admission = Admission(config.limits, quotas, config.rate_window_s, spend=spend)
    engines = Engines()
    metrics = Metrics(journal, spend)
    futures_ = Futures(journal, FutureBoard(loop), admission, config.long_poll_s, metrics)
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


def _engine_loop(name: str, engine: Any, state: ServerState, config: ServerConfig) -> EngineLoop:
    writer = CheckpointWriter(engine, state.store, state.journal, config.artifacts_dir)
    facts = EngineFacts(
        name=name,
        vocab_size=int(engine.vocab_size),
        max_seq_len=int(engine.max_seq_len),
        max_lora_rank=int(engine.max_lora_rank),
        arch=engine.arch,
    )
    return EngineLoop(
        facts,
        OpExecutor(engine, writer, config.max_snapshots_per_model),
        state.futures.finish,
        config.max_sample_batch,
        max_merge_tokens=config.max_merge_tokens,
    )


def _announce_mode(keyring: KeyRing) -> None:
    if keyring.dev_mode:
        log.warning(
            "no tenants in the database: single-user development mode, API keys are not "
            "checked (create one with `treadle admin create-tenant NAME`)"
        )
    else:
        log.info("tenants configured: every request needs an API key")


def _expire_sessions_of_previous_run(store: Store) -> None:
    with store.session.begin() as s:
        s.execute(update(SessionRow).where(SessionRow.status == "active").values(status="expired"))


async def _reap_idle_sessions(state: ServerState) -> None:
    period = min(5.0, state.config.heartbeat_timeout_s / 4)
    while True:
        await asyncio.sleep(period)
        try:
            await state.expire_idle_sessions()
        except Exception:
            log.exception("session reaper")
