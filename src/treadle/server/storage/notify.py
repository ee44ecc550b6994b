"""LISTEN/NOTIFY: how API processes sharing one PostgreSQL database wake each other.

A notification is sent inside the transaction that writes what it announces, so it is
delivered at commit, never before and never for a write that was rolled back: a request row
and the wake-up of the engine host, a result and the wake-up of its polls, commit together.
Each payload is "<sender>|<body>", the sender being the process's id: a process skips what
it sent itself (it acted on it already, in memory).

| channel | body | who listens: what for |
|---|---|---|
| treadle_ops | request_id key_id | the engine host: run a request another process filed |
| treadle_calls | call_id | the engine host: run a control call (load a sampler, ...) |
| treadle_done | request_id ... | every process: these results are committed |
| treadle_calls_done | call_id | every process: this control call has its answer |
| treadle_progress | base64 msgpack tokens | every process: tokens of a streamed sample filed elsewhere |
| treadle_ended | session ID STATUS, model ID | every process: forget them; the host frees them |
| treadle_models | (none) | every process: the served models' facts were written |

    notify = Notify(me); notify.op(conn, request_id, key_id)        # in a write's transaction
    listener = Listener(url, me, {OPS: on_op, DONE: on_done}); await listener.start()
"""

from __future__ import annotations

import asyncio
import base64
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from sqlalchemy import Connection, make_url, text

from treadle.server.runtime import messages
from treadle.server.runtime.ops import Progress

log = logging.getLogger("treadle.notify")

OPS, CALLS, DONE, CALLS_DONE = "treadle_ops", "treadle_calls", "treadle_done", "treadle_calls_done"
ENDED, MODELS, PROGRESS = "treadle_ended", "treadle_models", "treadle_progress"
MAX_PAYLOAD = 7000  # bytes; PostgreSQL's limit is 8000
# tokens of a streamed op per progress body: about 20 bytes each once encoded, far below it
PROGRESS_TOKENS = 200
# Key of the session-level advisory lock the engine host holds (one host per database).
HOST_LOCK = 0x74726561646C  # "treadl"
# TCP keepalives of the listening connection: a peer gone silent is noticed in ~15 s.
KEEPALIVES = {
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 3,
    "keepalives_count": 3,
}
_NOTIFY = text("SELECT pg_notify(:channel, :payload)")

Handler = Callable[[str], None]  # (body) on the event loop


class Notify:
    """The notifications of one process, each issued inside the caller's transaction."""

    def __init__(self, me: str):
        self.me = me

    def send(self, conn: Connection, channel: str, bodies: list[str]) -> None:
        """One notification per body, joined by spaces into as few payloads as fit."""
        payloads, part = [], ""
        for body in bodies:
            if part and len(part) + len(body) + 1 > MAX_PAYLOAD:
                payloads.append(part)
                part = ""
            part = f"{part} {body}" if part else body
        payloads.append(part)
        rows = [{"channel": channel, "payload": f"{self.me}|{p}"} for p in payloads]
        conn.execute(_NOTIFY, rows if len(rows) > 1 else rows[0])

    def op(self, conn: Connection, request_id: str, key_id: str | None) -> None:
        self.send(conn, OPS, [f"{request_id}:{key_id or ''}"])

    def done(self, conn: Connection, request_ids: list[str]) -> None:
        self.send(conn, DONE, request_ids)

    def call(self, conn: Connection, call_id: str) -> None:
        self.send(conn, CALLS, [call_id])

    def call_done(self, conn: Connection, call_id: str) -> None:
        self.send(conn, CALLS_DONE, [call_id])

    def session_ended(self, conn: Connection, session_id: str, status: str) -> None:
        self.send(conn, ENDED, [f"session:{session_id}:{status}"])

    def model_unloaded(self, conn: Connection, model_id: str) -> None:
        self.send(conn, ENDED, [f"model:{model_id}"])

    def models(self, conn: Connection) -> None:
        self.send(conn, MODELS, [""])

    def progress(self, conn: Connection, items: list[Progress]) -> None:
        self.send(conn, PROGRESS, encode_progress(items))


def encode_progress(items: list[Progress]) -> list[str]:
    """Progress as notification bodies (no spaces), each of at most PROGRESS_TOKENS tokens."""
    bodies = []
    for item in items:
        for start in range(0, len(item.tokens), PROGRESS_TOKENS):
            part = Progress(item.request_id, item.tokens[start : start + PROGRESS_TOKENS])
            bodies.append(base64.b64encode(messages.encode(part)).decode("ascii"))
    return bodies


def decode_progress(body: str) -> list[Progress]:
    return [messages.decode(base64.b64decode(b), Progress) for b in body.split()]


def conninfo(url: str) -> str:
    """A SQLAlchemy URL (postgresql+psycopg://...) → the libpq form psycopg connects with."""
    parsed = make_url(url).set(drivername="postgresql")
    return parsed.render_as_string(hide_password=False)


class Listener:
    """LISTENs on a connection of its own, on the event loop, and hands each notification
    that another process sent to the channel's handler. A lost connection is made again
    (backing off up to 2 s); `on_connect` then runs, to catch up with what was sent while
    nobody listened. `host_lock`: the connection also holds the engine host's advisory
    lock, so that a second engine host on the same database refuses to start."""

    def __init__(
        self,
        url: str,
        me: str,
        handlers: dict[str, Handler],
        on_connect: Callable[[], Awaitable[None]] | None = None,
        host_lock: bool = False,
    ):
        self.conninfo = conninfo(url)
        self.me = me
        self.handlers = handlers
        self.on_connect = on_connect
        self.host_lock = host_lock
        self._conn: Any = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Connected and listening (raises if the database cannot be reached, or if
        another engine host holds the lock)."""
        await self._connect()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        await self._close()

    async def _connect(self) -> None:
        import psycopg

        conn = await psycopg.AsyncConnection.connect(self.conninfo, autocommit=True, **KEEPALIVES)
        try:
            if self.host_lock:
                cur = await conn.execute("SELECT pg_try_advisory_lock(%s)", (HOST_LOCK,))
                if not (await cur.fetchone())[0]:
                    raise RuntimeError(
                        "another engine host serves this database (engine_host true): start "
                        "this server with --engine-host false, or stop the other one"
                    )
            for channel in self.handlers:
                await conn.execute(f"LISTEN {channel}")
        except BaseException:
            await conn.close()
            raise
        self._conn = conn

    async def _close(self) -> None:
        if self._conn is not None:
            try:
                await self._conn.close()
            except Exception:  # noqa: BLE001 - closing a broken connection
                pass
            self._conn = None

    async def _run(self) -> None:
        backoff = 0.1
        while True:
            try:
                if self._conn is None:
                    await self._connect()
                    log.info("listening again on the database")
                    backoff = 0.1
                    if self.on_connect is not None:
                        await self.on_connect()
                async for n in self._conn.notifies():
                    self._dispatch(n.channel, n.payload)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the connection broke: make it again
                log.warning("lost the database's notifications (%s); reconnecting", e)
                await self._close()
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, 2.0)

    def _dispatch(self, channel: str, payload: str) -> None:
        sender, _, body = payload.partition("|")
        handler = self.handlers.get(channel)
        if sender == self.me or handler is None:
            return
        try:
            handler(body)
        except Exception:
            log.exception("handling a notification on %s", channel)
