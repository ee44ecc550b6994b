"""The FastAPI app factory: settings, database, engines and every component are built in
the lifespan, never at import, and torn down with it.

    treadle serve --model treadle/tiny-llama=.models/tiny-llama
    treadle serve --model ... --db postgresql://db-host/treadle                       # engine host
    treadle serve --model ... --db postgresql://db-host/treadle --engine-host false   # + frontends

On a PostgreSQL database the processes find each other through it (treadle.server.core.
shared): the engine host runs the engines as a lone server does, a frontend none.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from treadle.errors import EngineDeadError, TreadleError
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
from treadle.server.api.tinker.bodies import BodyLimit, limit_by_route
from treadle.server.config import ServerConfig
from treadle.server.core.board import FutureBoard
from treadle.server.core.checkpoints import Checkpoints
from treadle.server.core.console import ConsoleViews
from treadle.server.core.engines import Engines
from treadle.server.core.futures import Futures
from treadle.server.core.limits import Admission
from treadle.server.core.metrics import Metrics
from treadle.server.core.models import TrainingModels
from treadle.server.core.recovery import Recovery
from treadle.server.core.samplers import Samplers
from treadle.server.core.sessions import Sessions
from treadle.server.core.shared import Shared
from treadle.server.core.state import ServerState
from treadle.server.registry.bindings import Bindings
from treadle.server.registry.sources import packages_root
from treadle.server.runtime.checkpoint_writer import CheckpointWriter
from treadle.server.runtime.engine_client import EngineFacts, SnapshotPolicy
from treadle.server.runtime.engine_loop import EngineLoop
from treadle.server.runtime.executor import OpExecutor
from treadle.server.runtime.forward import ControlCalls
from treadle.server.runtime.hub import WorkerHub
from treadle.server.runtime.journal import Journal
from treadle.server.runtime.remote import TOKEN_ENV, RemoteEngine
from treadle.server.runtime.replicas import ReplicatedEngine
from treadle.server.runtime.scheduler import ParkLimits
from treadle.server.runtime.supervisor import Supervisor
from treadle.server.storage import artifacts
from treadle.server.storage.database import Store
from treadle.server.storage.notify import Notify
from treadle.server.storage.rows import new_id
from treadle.server.tenancy.auth import KeyRing, TenantMiddleware, install_tenant_filter
from treadle.server.tenancy.quotas import QuotaBook
from treadle.server.tenancy.signing import Signer
from treadle.server.tenancy.spend import KeyIdMiddleware, SpendBook

log = logging.getLogger("treadle.server")

EngineFactory = Callable[[str, str, ServerConfig], Any]  # (name, folder, config) → Engine
SPEND_RELOAD_S = 5.0


def default_engine_factory(name: str, model_dir: str, config: ServerConfig) -> Any:
    from treadle.engine.engine import Engine

    return Engine(
        model_dir,
        dtype=config.dtype,
        device=config.device,
        model_name=name,
        **engine_options(config),
    )


def engine_options(config: ServerConfig) -> dict[str, Any]:
    """The Engine's memory settings and context length, from the config."""
    from treadle.engine.memory import MemorySettings

    def gib(v: float | None) -> int | None:
        return None if v is None else int(v * (1 << 30))

    memory = MemorySettings(
        config.activation_checkpointing,
        gib(config.memory_budget_gb),
        gib(config.checkpoint_above_gb),
    )
    return {"memory": memory, "max_seq_len": config.max_context}


def create_app(config: ServerConfig, engine_factory: EngineFactory | None = None) -> FastAPI:
    make_engine = engine_factory or default_engine_factory

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        Path(config.data_dir).mkdir(parents=True, exist_ok=True)
        root = packages_root(config)
        if config.engine_host:  # a frontend starts while the host may be writing there
            artifacts.remove_leftovers([config.artifacts_dir, root], [root.parent / "cache"])
        store = Store(config.resolved_db_url)
        remove_filter = install_tenant_filter(store.session)
        journal = Journal(store.engine)
        journal.start()
        notify = Notify(new_id()) if store.shared else None  # other API processes may join
        state = _build_state(config, store, journal, asyncio.get_running_loop(), notify)
        shared = None
        if notify is not None:
            calls = ControlCalls(journal, notify, config.engine_down_timeout_s)
            shared = Shared(state, notify, calls)
        recovery = Recovery(state)
        engines: _ThreadEngines | _ProcessEngines | None = None
        if config.engine_host:
            engines = (
                _ProcessEngines(config, state, recovery)
                if config.engine_processes
                else _ThreadEngines(config, state, recovery, make_engine)
            )
        # what tenants and keys spent this day and month, before any engine runs
        await asyncio.to_thread(state.admission.spend.load)
        app.state.console = ConsoleViews(
            config, store, state.engines, state.futures.metrics, state.admission.spend
        )
        state.futures.metrics.start()
        tasks: list[asyncio.Task] = []
        try:
            if shared is not None:
                await shared.listen()  # before recovery reads the requests left pending
            if engines is not None:
                await engines.start()
            if shared is not None:
                await (shared.announce() if engines is not None else shared.join())
                await shared.open()
                tasks.append(asyncio.create_task(shared.keep_seen()))
            for name, path in config.models.items():
                state.tokenizer_dirs[name] = await asyncio.to_thread(_tokenizer_dir, path, config)
            app.state.server = state
            app.state.keyring = state.keyring
            app.state.openai = OpenAIServing(state)
            _announce_mode(state.keyring)
            if config.engine_host:  # the host ends silent sessions, for every process
                tasks.append(asyncio.create_task(_reap_idle_sessions(state)))
            else:  # the host counts what results spend; a frontend reads it
                tasks.append(asyncio.create_task(_reload_spend(state)))
            yield
        finally:
            for task in tasks:
                task.cancel()
            if shared is not None:  # no more requests of other processes are taken
                await shared.stop()
            if engines is not None:
                await engines.stop()  # first: their last outcomes go to the journal
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
    notify: Notify | None = None,
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
        notify=notify,
    )
    sessions_ = Sessions(store, journal, admission, notify)
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
        models=TrainingModels(
            store, journal, sessions_, engines, admission, futures_, bindings, notify
        ),
        samplers=Samplers(store, journal, sessions_, engines, checkpoints_),
        checkpoints=checkpoints_,
        bindings=bindings,
        keyring=keyring,
        signer=Signer(),
    )


def park_limits(config: ServerConfig) -> ParkLimits:
    return ParkLimits(config.max_parked_ops, config.max_parked_bytes, config.parked_op_timeout_s)


def _tokenizer_dir(model_path: str, config: ServerConfig) -> Path:
    from treadle.engine.models import tokenizer_folder

    return tokenizer_folder(model_path, Path(config.data_dir) / "tokenizers")


class _ThreadEngines:
    """Each model's engine on a thread of this process (engine_processes false)."""

    def __init__(self, config: ServerConfig, state: ServerState, recovery: Recovery, make: Any):
        self.config, self.state, self.recovery, self.make = config, state, recovery, make

    async def start(self) -> None:
        config, state = self.config, self.state
        for name, path in config.models.items():
            log.info("loading model %s from %s", name, path)
            engine = await asyncio.to_thread(self.make, name, path, config)
            writer = CheckpointWriter(engine, state.store, state.journal, config.artifacts_dir)
            executor = OpExecutor(
                engine, writer, config.max_snapshots_per_model, state_root=config.state_dir
            )
            state.engines.add(
                EngineLoop(
                    EngineFacts.of(name, engine),
                    executor,
                    state.futures.finish,
                    config.max_sample_batch,
                    max_merge_tokens=config.max_merge_tokens,
                    on_snapshot=self.recovery.snapshot_written if config.durable else None,
                    snapshots=SnapshotPolicy(config.snapshot_every_steps, config.snapshot_every_s),
                    park=park_limits(config),
                    on_progress=state.futures.progress,
                )
            )
        self.recovery.load()
        for engine in state.engines.all():
            engine.start()
            try:
                await self.recovery.restore_engine(engine)
            except EngineDeadError:  # no process to restart here: its requests say so
                log.exception("the engine of %s stopped while restoring its models", engine.name)

    async def stop(self) -> None:
        for engine in self.state.engines.all():
            await _drain(engine, self.config.drain_timeout_s)
            engine.stop()


async def _drain(engine: EngineLoop, timeout_s: float) -> None:
    """Run what was acknowledged (up to timeout_s), then write every model's state."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while engine.busy() and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    try:
        await asyncio.wait_for(engine.snapshot_all(), timeout_s)
    except Exception:
        log.exception("final snapshots of %s failed", engine.name)


class _ProcessEngines:
    """Each model's engine in a worker process, connected through the hub."""

    def __init__(self, config: ServerConfig, state: ServerState, recovery: Recovery):
        self.config, self.state, self.recovery = config, state, recovery
        token = config.worker_token or os.environ.get(TOKEN_ENV) or secrets.token_hex(16)
        self.hub = WorkerHub(config.worker_address, token)
        self.supervisor: Supervisor | None = None

    async def start(self) -> None:
        config, state = self.config, self.state
        loop = asyncio.get_running_loop()
        for name in config.models:

            def replica(index: int, on_ready: Any, name: str = name) -> RemoteEngine:
                return RemoteEngine(
                    name,
                    self.hub,
                    state.futures.finish,
                    self.recovery.snapshot_written,
                    on_ready,
                    loop,
                    config.engine_down_timeout_s,
                    replica=index,
                    on_progress=state.futures.progress,
                )

            group = ReplicatedEngine(
                name,
                replica,
                self.recovery.restore_engine,
                loop,
                replicas=config.replicas,
                failover_after_s=config.failover_after_s,
            )
            self.hub.engines[name] = group
            state.engines.add(group)
        self.recovery.load()
        self.hub.start()
        log.info("workers connect to %s", self.hub.address)
        if config.start_workers:
            self.supervisor = Supervisor(
                config, self.hub.address, self.hub.token, self.hub.worker_exited
            )
            self.supervisor.start()
        groups = list(self.hub.engines.values())
        while not all(r.ready for g in groups for r in g.replicas):  # every model restored
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        if self.supervisor is not None:  # the workers drain on SIGTERM, then exit
            await asyncio.to_thread(self.supervisor.stop)
        else:
            for group in self.hub.engines.values():
                group.stop()
        self.hub.stop()


def _announce_mode(keyring: KeyRing) -> None:
    if keyring.dev_mode:
        log.warning(
            "no tenants in the database: single-user development mode, API keys are not "
            "checked (create one with `treadle admin create-tenant NAME`)"
        )
    else:
        log.info("tenants configured: every request needs an API key")


async def _reload_spend(state: ServerState) -> None:
    """A frontend: what tenants and keys spent, read again every few seconds while spend
    caps exist (the engine host counts each result as it records it)."""
    spend = state.admission.spend
    while True:
        await asyncio.sleep(SPEND_RELOAD_S)
        try:
            if spend is not None and await asyncio.to_thread(spend.caps):
                await asyncio.to_thread(spend.load)
        except Exception:
            log.exception("reading what was spent")


async def _reap_idle_sessions(state: ServerState) -> None:
    period = min(5.0, state.config.heartbeat_timeout_s / 4)
    while True:
        await asyncio.sleep(period)
        try:
            await state.expire_idle_sessions()
        except Exception:
            log.exception("session reaper")
