"""The workers of every served model, from the API side: the hub they connect to, one handle
per model (a ReplicatedEngine over a WorkerEngine per replica), and what starts them.

Workers are processes the supervisor starts and restarts (the default), threads of this
process (`--engine-processes false`: treadle.server.engines.threads), or processes someone
else starts (`--start-workers false`: `treadle worker --connect ...` on other machines). All
three speak the same protocol to the same hub; the rest of the server sees EngineClients.

Start-up ends when every model's workers serve, or as soon as one model is given up (its
worker cannot load it: CannotStart with the reason), or a signal asks the server to stop
(StartCancelled): nothing waits forever for a worker that is not coming.

    workers = Workers(config, hooks, make_engine); await workers.start(); ...; await workers.stop()
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import threading
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from treadle.protocol.worker_config import TOKEN_ENV
from treadle.server.config import ServerConfig
from treadle.server.engines.client import OnOutcomes, OnProgress, OnSnapshot
from treadle.server.engines.hub import WorkerHub
from treadle.server.engines.remote import WorkerEngine
from treadle.server.engines.replicas import ReplicatedEngine, Restore
from treadle.server.engines.startup import CannotStart, StartCancelled
from treadle.server.engines.supervisor import Supervisor
from treadle.server.engines.threads import EngineFactory, ThreadWorkers

log = logging.getLogger("treadle.server")


@dataclass
class Hooks:
    """What the rest of the API hears from the workers, and what it restores on them."""

    on_outcomes: OnOutcomes
    on_progress: OnProgress
    on_snapshot: OnSnapshot
    restore: Restore  # a worker said HELLO: restore its models (treadle.server.core.recovery)
    models_of: Callable[[str], list[str]]  # a served model's training models


class Workers:
    def __init__(self, config: ServerConfig, hooks: Hooks, make_engine: EngineFactory):
        self.config, self.hooks, self.make_engine = config, hooks, make_engine
        token = config.worker_token or os.environ.get(TOKEN_ENV) or secrets.token_hex(16)
        address = config.worker_address
        if not config.engine_processes:  # threads of this process: an in-process socket
            address = f"inproc://treadle-workers-{uuid.uuid4().hex}"
        self.hub = WorkerHub(address, token)
        self.handles: dict[str, ReplicatedEngine] = {}
        self.starter: Supervisor | ThreadWorkers | None = None

    def handles_for(self, loop: asyncio.AbstractEventLoop) -> list[ReplicatedEngine]:
        """One handle per served model (made once, before any worker starts)."""
        config, hooks = self.config, self.hooks
        for name in config.models:

            def replica(
                index: int, on_ready: Callable[[WorkerEngine], Awaitable[None]], name: str = name
            ) -> WorkerEngine:
                return WorkerEngine(
                    name,
                    self.hub,
                    hooks.on_outcomes,
                    hooks.on_snapshot,
                    on_ready,
                    loop,
                    config.engine_down_timeout_s,
                    replica=index,
                    on_progress=hooks.on_progress,
                )

            self.handles[name] = ReplicatedEngine(
                name,
                replica,
                hooks.restore,
                loop,
                replicas=config.replicas,
                failover_after_s=config.failover_after_s,
                models_of=lambda name=name: hooks.models_of(name),
            )
            self.hub.engines[name] = self.handles[name]
        return list(self.handles.values())

    async def start(self, stop: threading.Event | None = None) -> None:
        """Start the hub and the workers; → once every model's workers serve (restored).
        CannotStart: a model was given up (the reason); StartCancelled: `stop` was set."""
        self.hub.start()
        log.info("workers connect to %s", self.hub.address)
        config, hub = self.config, self.hub
        if not config.engine_processes:
            self.starter = ThreadWorkers(
                config,
                hub.address,
                hub.token,
                hub.worker_exited,
                self.make_engine,
                on_given_up=hub.worker_given_up,
            )
        elif config.start_workers:
            self.starter = Supervisor(
                config,
                hub.address,
                hub.token,
                hub.worker_exited,
                on_given_up=hub.worker_given_up,
                attaches=hub.attaches,
            )
        if self.starter is not None:
            self.starter.start()
        replicas = [r for h in self.handles.values() for r in h.replicas]
        while not all(r.ready for r in replicas):  # every model restored
            failed = next((r.failure for r in replicas if r.failure is not None), None)
            if failed is not None:
                raise CannotStart(failed)
            if stop is not None and stop.is_set():
                raise StartCancelled("stopped while the workers were starting")
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        """Drain the workers (what was acknowledged runs, every model's state is written)."""
        if self.starter is not None:
            await asyncio.to_thread(self.starter.stop)
        else:  # workers started elsewhere: asked to drain
            for handle in self.handles.values():
                handle.stop()
        self.hub.stop()
