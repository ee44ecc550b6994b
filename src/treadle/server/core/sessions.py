"""Client sessions: made by create_session, kept alive by heartbeats, ended by close() or
by silence (heartbeat_timeout_s). Ending a session frees its models and samplers
(treadle.server.core.state.ServerState.end_session).

The sessions of this process are held in memory (every call of a session touches it, so a
lookup must cost no database read); one this process does not know was ended by a
previous run, and is looked up once in the database to say so.

On a database several API processes share (`notify` given: treadle.server.core.shared),
memory is a cache: a session another process made is read once and adopted, one another
process ended is forgotten when its notification arrives (`ended_elsewhere`), and the signs
of life each process saw are written every few seconds (`flush_seen`), so that the engine
host's reaper ends only sessions that no process has heard from (`silent`).
"""

from __future__ import annotations

import functools
import time
from typing import Any

from treadle.errors import NotFoundError, SessionGoneError
from treadle.server.core.limits import Admission
from treadle.server.runtime.journal import Journal
from treadle.server.storage.database import Store
from treadle.server.storage.notify import Notify
from treadle.server.storage.queries import (
    held_by_tenant,
    insert_row,
    mark_session_ended,
    silent_sessions,
    touch_sessions,
)
from treadle.server.storage.rows import SessionRow, new_id, utcnow
from treadle.server.tenancy.auth import Tenant, owns


class Sessions:
    def __init__(
        self, store: Store, journal: Journal, admission: Admission, notify: Notify | None = None
    ):
        self.store = store
        self.journal = journal
        self.admission = admission
        self.notify = notify  # several API processes on one database
        self._last_seen: dict[str, float] = {}  # active session → monotonic time of last sign
        self._ended: dict[str, str] = {}  # sessions this process ended → finished|expired
        self._tenant: dict[str, str] = {}  # sessions of this process → tenant_id
        self._seen: set[str] = set()  # signs of life not written yet (shared database)

    async def create(
        self,
        tenant: Tenant,
        tags: list[str],
        user_metadata: dict[str, Any] | None,
        display_name: str | None,
        sdk_version: str | None,
    ) -> str:
        if self.notify is None:
            active = self.active_count(tenant.tenant_id)
        else:  # every API process's sessions count
            active = (await self.journal.run(lambda c: held_by_tenant(c, tenant.tenant_id)))[0]
        self.admission.check_sessions(tenant, active)
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
            "created_at": now,
            "last_seen_at": now,
        }
        await self.journal.run(functools.partial(insert_row, cls=SessionRow, values=values))
        self._tenant[session_id] = tenant.tenant_id
        self._last_seen[session_id] = time.monotonic()
        return session_id

    def require(self, session_id: str) -> None:
        """An active session of this process (and a sign of life from it), else 404/410.

        Another tenant's session is looked up exactly as an unknown id is (one database
        read, then 404): answering it from memory would be faster, and the difference would
        tell whoever holds a leaked id that it is live."""
        owner = self._tenant.get(session_id)
        mine = owner is not None and owns(owner)
        if mine and session_id in self._last_seen:
            self._last_seen[session_id] = time.monotonic()
            if self.notify is not None:
                self._seen.add(session_id)
            return
        status = self._ended.get(session_id) if mine else None
        if status is None:  # not one of ours: ended by a previous run, or no such session
            row = self.store.get(SessionRow, session_id)
            if row is None or not owns(row.tenant_id):
                raise NotFoundError(f"session_id {session_id!r} not found")
            if row.status == "active" and self.notify is not None:
                self.restore(session_id, row.tenant_id)  # made by another API process
                return
            status = row.status if row.status != "active" else "ended"
        raise SessionGoneError(
            f"session {session_id!r} has {status}; its models were unloaded "
            "(saved checkpoints remain): create a new session"
        )

    def restore(self, session_id: str, tenant_id: str) -> None:
        """A session still active when the previous run stopped, or one another API process
        made: its clock starts again."""
        self._tenant[session_id] = tenant_id
        self._last_seen[session_id] = time.monotonic()
        if self.notify is not None:
            self._seen.add(session_id)

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
        self.ended_elsewhere(session_id, status)
        notify = self.notify

        def write(conn: Any) -> tuple[list, list]:
            held = mark_session_ended(conn, session_id, status)
            if notify is not None:  # the other API processes forget it; the host frees it
                notify.session_ended(conn, session_id, status)
            return held

        return await self.journal.run(write)

    def ended_elsewhere(self, session_id: str, status: str) -> None:
        """Forget an active session (ended here, or by another API process)."""
        self._last_seen.pop(session_id, None)
        self._seen.discard(session_id)
        if session_id in self._tenant:  # one this process never held is read if asked for
            self._ended[session_id] = status

    def cached(self) -> list[str]:
        """The sessions this process holds as active."""
        return list(self._last_seen)

    # ---- signs of life on a shared database ----
    async def flush_seen(self) -> None:
        """Write the signs of life seen since the last flush (one statement)."""
        seen, self._seen = self._seen, set()
        if seen:
            await self.journal.run(functools.partial(touch_sessions, session_ids=sorted(seen)))

    async def silent(self, timeout_s: float) -> list[str]:
        """Active sessions no API process has heard from for over timeout_s (this one's
        signs of life written first)."""
        await self.flush_seen()
        return await self.journal.run(functools.partial(silent_sessions, timeout_s=timeout_s))
