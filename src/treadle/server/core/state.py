"""The server's components, built once by the app's lifespan and handed to every route.

Each component owns its own state and is used through its methods; the few rules that
span components live here: ending a session frees its models and samplers, and a tenant's
adapter quota counts both.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from treadle.server.config import ServerConfig
from treadle.server.core.checkpoints import Checkpoints
from treadle.server.core.completions import Completions
from treadle.server.core.custom_losses import CustomLosses
from treadle.server.core.futures import Futures
from treadle.server.core.limits import Admission
from treadle.server.core.models import TrainingModels
from treadle.server.core.samplers import Samplers
from treadle.server.core.sessions import Sessions
from treadle.server.engines.served import Engines
from treadle.server.registry.bindings import Bindings
from treadle.server.storage.database import Store
from treadle.server.storage.journal import Journal
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
    custom_losses: CustomLosses
    completions: Completions
    tokenizer_dirs: dict[str, Path] = field(default_factory=dict)
    """Per served model: a folder AutoTokenizer loads (a GGUF's is extracted at start-up)."""

    def check_adapter_slot(self, tenant: Tenant) -> None:
        """The max_adapters_in_memory quota: training models plus loaded samplers."""
        self.admission.check_adapters(tenant, self.held_adapters(tenant))

    def held_adapters(self, tenant: Tenant) -> int:
        return self.models.active_count(tenant.tenant_id) + self.samplers.loaded_count(
            tenant.tenant_id
        )

    async def end_session(self, session_id: str, status: str) -> None:
        """Mark the session ended and free its adapters and samplers from engine memory."""
        models, samplers = await self.sessions.mark_ended(session_id, status)
        await self._free(session_id, status, models, samplers)

    async def _free(self, session_id: str, status: str, models: list, samplers: list) -> None:
        reason = f"session {session_id!r} {status} before this request ran"
        await self.models.on_session_ended(models, reason)
        await self.samplers.on_session_ended(samplers)

    async def expire_idle_sessions(self) -> list[str]:
        idle = self.sessions.idle(self.config.heartbeat_timeout_s)
        for sid in idle:
            log.info(
                "session %s silent for over %.0f s: ending it",
                sid,
                self.config.heartbeat_timeout_s,
            )
            await self.end_session(sid, "expired")
        return idle
