"""The server session of a ServiceClient: opened on first use, kept alive by a heartbeat,
finished once; and the two seq_id counters the protocol numbers within it.

`create_session` is sent when something first needs the session's id; a heartbeat then
goes every HEARTBEAT_S (the server ends a session whose beats stop); `finish` sends
`sessions/{id}/finish` once, without retries, and a later use opens a new session.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading

from treadle.client.errors import APIError, GoneError
from treadle.client.transport import SDK_VERSION, Transport
from treadle.wire import requests as rq

log = logging.getLogger("treadle.client")

HEARTBEAT_S = 10.0


class ServerSession:
    def __init__(
        self,
        transport: Transport,
        user_metadata: dict[str, str] | None = None,
        project_id: str | None = None,
        display_name: str | None = None,
    ):
        self.transport = transport
        self._request = rq.CreateSessionRequest(
            user_metadata=user_metadata,
            sdk_version=SDK_VERSION,
            project_id=project_id,
            display_name=display_name,
        )
        self._lock = threading.Lock()
        self._id: str | None = None
        self._heartbeat: concurrent.futures.Future | None = None
        self._model_seqs = itertools.count()
        self._sampling_seqs = itertools.count()

    @property
    def id(self) -> str:
        """The session's id, created on first use."""
        with self._lock:
            if self._id is None:
                post = self.transport.post("/api/v1/create_session", self._request)
                self._id = str(self.transport.call(post)["session_id"])
                self._model_seqs, self._sampling_seqs = itertools.count(), itertools.count()
                self._heartbeat = self.transport.submit(self._beat(self._id))
            return self._id

    def name_if_unnamed(self, name: str) -> None:
        """The name the session is opened with, if it is not open and has none yet."""
        with self._lock:
            if self._id is None and self._request.display_name is None:
                self._request.display_name = name

    def next_model_seq_id(self) -> tuple[str, int]:
        """create_model and load_weights number the session's models with one counter."""
        session_id = self.id
        with self._lock:
            return session_id, next(self._model_seqs)

    def next_sampling_seq_id(self) -> tuple[str, int]:
        """create_sampling_session and snapshot saves share one counter per session."""
        session_id = self.id
        with self._lock:
            return session_id, next(self._sampling_seqs)

    def finish(self, reason: str = "success") -> None:
        """Stop the heartbeat and finish the session on the server (if one is open)."""
        with self._lock:
            session_id, self._id = self._id, None
            heartbeat, self._heartbeat = self._heartbeat, None
        if heartbeat is not None:
            heartbeat.cancel()
        if session_id is None:
            return
        body = rq.SessionFinishRequest(reason=rq.FinishReason(type=reason))
        path = f"/api/v1/sessions/{session_id}/finish"
        try:
            # No retries: a server that is gone must not hold up close() or interpreter exit;
            # it ends the session itself once heartbeats stop.
            self.transport.call(self.transport.post(path, body, retry=False, timeout=10))
        except APIError as exc:  # not worth a warning: the server ends it all the same
            log.info("finishing session %s failed (it expires on the server): %s", session_id, exc)

    async def _beat(self, session_id: str) -> None:
        body = rq.SessionHeartbeatRequest(session_id=session_id)
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            try:
                await self.transport.post("/api/v1/session_heartbeat", body, retry=False)
            except GoneError:
                log.info("session %s has finished; heartbeat stopped", session_id)
                return
            except APIError as exc:  # a missed beat is not fatal; the server allows several
                log.warning("heartbeat of session %s failed: %s", session_id, exc)
