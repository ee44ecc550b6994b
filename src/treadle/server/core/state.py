"""The server's components, built once by the app's lifespan and handed to every route.

Each component owns its own state and is used through its methods; the few rules that
span components live here: ending a session frees its models and samplers, and a tenant's
adapter quota counts both.

On a database several API processes share (`shared`), the engine host frees what a session
held, whoever ended it; the quotas count every process's sessions and adapters (from the
database); and sessions are ended for silence only when no process has heard from them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from treadle.server.config import ServerConfig
from treadle.server.core.checkpoints import Checkpoints
from treadle.server.core.engines import Engines
from treadle.server.core.futures import Futures
from treadle.server.core.limits import Admission
from treadle.server.core.models import TrainingModels
from treadle.server.core.samplers import Samplers
from treadle.server.core.sessions import Sessions
from treadle.server.registry.bindings import Bindings
from treadle.server.runtime.journal import Journal
from treadle.server.storage.database import Store
from treadle.server.storage.queries import held_by_tenant, session_holdings
from treadle.server.tenancy.auth import KeyRing, Tenant
from treadle.server.tenancy.signing import Signer

log = logging.getLogger("treadle.state")


@dataclass
class ServerState:
    config: ServerConfig
    store: Store
    journal: Journal
    engines: Engines
    admission: Admission
    futures: Futures
    sessions: Sessions
    models: TrainingModels
    samplers: Samplers
    checkpoints: Checkpoints
    bindings: Bindings
    keyring: KeyRing
    signer: Signer
    tokenizer_dirs: dict[str, Path] = field(default_factory=dict)
    """Per served model: a folder AutoTokenizer loads (a GGUF's is extracted at start-up)."""

    @property
    def shared(self) -> bool:
        """Whether other API processes may use the same database."""
        return self.store.shared

    def check_adapter_slot(self, tenant: Tenant) -> None:
        """The max_adapters_in_memory quota: training models plus loaded samplers."""
        self.admission.check_adapters(tenant, self.held_adapters(tenant))

    def held_adapters(self, tenant: Tenant) -> int:
        if self.shared:  # every API process's (one read: models and samplers are not hot)
            with self.store.engine.connect() as conn:
                return held_by_tenant(conn, tenant.tenant_id)[1]
        return self.models.active_count(tenant.tenant_id) + self.samplers.loaded_count(
            tenant.tenant_id
        )

    async def end_session(self, session_id: str, status: str) -> None:
        """Mark the session ended and free its adapters and samplers from engine memory."""
        models, samplers = await self.sessions.mark_ended(session_id, status)
        await self._free(session_id, status, models, samplers)

    async def session_ended_elsewhere(self, session_id: str, status: str) -> None:
        """Another API process ended a session: forget it; the engine host frees what its
        engines hold of it."""
        self.sessions.ended_elsewhere(session_id, status)
        with self.store.engine.connect() as conn:
            models, samplers = session_holdings(conn, session_id)
        models = [(m, b) for m, b in models if self._holds(b, m)]
        samplers = [(s, b, ref) for s, b, ref in samplers if ref is None or self._holds(b, ref)]
        await self._free(session_id, status, models, samplers)

    def _holds(self, base_model: str, ref: str) -> bool:
        engine = self.engines.get(base_model)
        return engine is not None and (engine.has_model(ref) or engine.is_live(ref))

    async def _free(self, session_id: str, status: str, models: list, samplers: list) -> None:
        reason = f"session {session_id!r} {status} before this request ran"
        if not self.config.engine_host:  # the engine host frees them when it hears of it
            samplers = [(s, b, None) for s, b, _ in samplers]
        await self.models.on_session_ended(models, reason)
        await self.samplers.on_session_ended(samplers)

    async def expire_idle_sessions(self) -> list[str]:
        if self.shared:  # silent to every API process, not only to this one
            idle = await self.sessions.silent(self.config.heartbeat_timeout_s)
        else:
            idle = self.sessions.idle(self.config.heartbeat_timeout_s)
        for sid in idle:
            log.info(
                "session %s silent for over %.0f s: ending it",
                sid,
                self.config.heartbeat_timeout_s,
            )
            await self.end_session(sid, "expired")
        return idle
