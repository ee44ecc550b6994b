"""Client sessions: made by create_session, kept alive by heartbeats, ended by close() or
by silence (heartbeat_timeout_s). Ending a session frees its models and samplers
(treadle.server.core.state.ServerState.end_session).

The sessions of this process are held in memory (every call of a session touches it, so a
lookup must cost no database read); one this process does not know was ended by a
previous run, and is looked up once in the database to say so.

A session's name (its display_name: the console's Name column, its search, the usage by
session) is the one create_session gives, else the first training session name
(`training_session_name`, the managed service's argument, which the SDK also sends in the
model's user_metadata) of a model created in it.
"""

from __future__ import annotations

import functools
import time
from typing import Any

from treadle.errors import NotFoundError, SessionGoneError
from treadle.server.core.limits import Admission
from treadle.server.storage.database import Store
from treadle.server.storage.journal import Journal
from treadle.server.storage.queries import insert_row, mark_session_ended, name_session
from treadle.server.storage.rows import SessionRow, new_id, utcnow
from treadle.server.tenancy.auth import Tenant, owns


class Sessions:
    def __init__(self, store: Store, journal: Journal, admission: Admission):
        self.store = store
        self.journal = journal
        self.admission = admission
        self._last_seen: dict[str, float] = {}  # active session → monotonic time of last sign
        self._ended: dict[str, str] = {}  # sessions this process ended → finished|expired
        self._tenant: dict[str, str] = {}  # sessions of this process → tenant_id

    async def create(
        self,
        tenant: Tenant,
        tags: list[str],
        user_metadata: dict[str, Any] | None,
        display_name: str | None,
        sdk_version: str | None,
        project_id: str | None = None,
    ) -> str:
        self.admission.check_sessions(tenant, self.active_count(tenant.tenant_id))
        session_id = new_id()
        now = utcnow()
        values = {
            "session_id": session_id,
            "tenant_id": tenant.tenant_id,
            "status": "active",
            "tags": list(tags),
            "user_metadata": user_metadata,
            "display_name": display_name,
            "sdk_version": sdk_version,
            "project_id": project_id,
            "created_at": now,
            "last_seen_at": now,
        }
        await self.journal.run(functools.partial(insert_row, cls=SessionRow, values=values))
        self._tenant[session_id] = tenant.tenant_id
        self._last_seen[session_id] = time.monotonic()
        return session_id

    async def name(self, session_id: str, name: str) -> None:
        """Name a session that has no name yet."""
        await self.journal.run(functools.partial(name_session, session_id=session_id, name=name))

    def require(self, session_id: str) -> None:
        """An active session of this process (and a sign of life from it), else 404/410.

        Another tenant's session is looked up exactly as an unknown id is (one database
        read, then 404): answering it from memory would be faster, and the difference would
        tell whoever holds a leaked id that it is live."""
        owner = self._tenant.get(session_id)
        mine = owner is not None and owns(owner)
        if mine and session_id in self._last_seen:
            self._last_seen[session_id] = time.monotonic()
            return
        status = self._ended.get(session_id) if mine else None
        if status is None:  # not one of ours: ended by a previous run, or no such session
            row = self.store.get(SessionRow, session_id)
            if row is None or not owns(row.tenant_id):
                raise NotFoundError(f"session_id {session_id!r} not found")
            status = row.status if row.status != "active" else "ended"
        raise SessionGoneError(
            f"session {session_id!r} has {status}; its models were unloaded "
            "(saved checkpoints remain): create a new session"
        )

    def restore(self, session_id: str, tenant_id: str) -> None:
        """A session still active when the previous run stopped: its clock starts again."""
        self._tenant[session_id] = tenant_id
        self._last_seen[session_id] = time.monotonic()

    def is_active(self, session_id: str) -> bool:
        return session_id in self._last_seen

    def tenant_of(self, session_id: str) -> str | None:
        return self._tenant.get(session_id)

    def active_count(self, tenant_id: str) -> int:
        return sum(1 for s in self._last_seen if self._tenant.get(s) == tenant_id)

    def idle(self, timeout_s: float) -> list[str]:
        """Active sessions silent for longer than timeout_s."""
        cutoff = time.monotonic() - timeout_s
        return [sid for sid, seen in list(self._last_seen.items()) if seen < cutoff]

    async def mark_ended(self, session_id: str, status: str) -> tuple[list, list]:
        """→ the session's (model_id, base_model) and (sampling_session_id, base_model,
        engine_ref), for the caller to free."""
        self._last_seen.pop(session_id, None)
        if session_id in self._tenant:  # one this process never held is read if asked for
            self._ended[session_id] = status
        return await self.journal.run(
            functools.partial(mark_session_ended, session_id=session_id, status=status)
        )

    def cached(self) -> list[str]:
        """The sessions this process holds as active."""
        return list(self._last_seen)
