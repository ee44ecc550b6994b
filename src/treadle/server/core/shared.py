"""Several API processes on one PostgreSQL database: one runs the engines, all serve.

One `treadle serve` is the engine host (`engine_host` true, the default): it runs the hub
its workers connect to, as a lone server does, and holds an advisory lock so that it stays
the only one. Any number of others are frontends (`--engine-host false`): they file requests
and answer polls for the same sessions, behind any load balancer, so that a request may
arrive at any of them. What they need of each other travels through the database itself:

- a request filed by a frontend is its row, committed with a notification (treadle_ops);
  the host loads the row and submits the op to its engine (`_take`), adopting the model and
  its session when it did not know them; a request it cannot take (a model unloaded, a
  seq_id used) fails like any other;
- every result is committed with a notification (treadle_done); each process resolves the
  polls it holds for it (Futures.resolve_elsewhere), whoever filed the request;
- a control call of a frontend (a sampler loaded from a checkpoint, an adapter checked
  before an import) is a row of control_calls (treadle_calls), run by the host, answered
  in its row (treadle_calls_done; treadle.server.runtime.forward.ControlCalls);
- the tokens of a streamed sample filed by a frontend are notified as they are sampled
  (treadle_progress), ahead of its result, so that its stream is live there too;
- a session or model ended anywhere is announced (treadle_ended): every process forgets
  it, and the host frees what its engines hold of it;
- the host writes its models' facts when its engines are up (served_models, treadle_models),
  which a frontend waits for before it serves;
- each process writes the signs of life it saw every few seconds; the host's reaper ends a
  session only when no process has heard from it (treadle.server.core.sessions).

Memory in each process is a cache over the database: a session, model or sampler made
elsewhere is read and adopted on first use. No timer polls the database: a notification
wakes whoever waits, and a process whose listening connection broke catches up once it is
back (`catch_up`: what is pending is read again).

With SQLite (one process) none of this runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from typing import Any

from sqlalchemy import Connection

from treadle.errors import InvalidRequestError, NotFoundError, TreadleError
from treadle.server.core.state import ServerState
from treadle.server.runtime.engine_client import EngineClient
from treadle.server.runtime.forward import (
    CONTROL_CALLS,
    ControlCalls,
    ForwardEngine,
    error_record,
    facts_of,
    facts_row,
)
from treadle.server.runtime.messages import decode_payload
from treadle.server.runtime.ops import Op, OpKind, Outcome, Sample
from treadle.server.storage import queries
from treadle.server.storage.notify import (
    CALLS,
    CALLS_DONE,
    DONE,
    ENDED,
    MODELS,
    OPS,
    PROGRESS,
    Listener,
    Notify,
    decode_progress,
)

log = logging.getLogger("treadle.shared")

# How often each process writes the signs of life it saw (at most; a quarter of the
# heartbeat timeout when that is shorter), and how often a frontend says it still waits.
SEEN_EVERY_S = 5.0
WAITING_LOG_S = 10.0


class Shared:
    """One API process's part: its listener, and what it does with each notification."""

    def __init__(self, state: ServerState, notify: Notify, calls: ControlCalls):
        self.state = state
        self.notify = notify
        self.calls = calls
        self.host = state.config.engine_host
        self._open = False  # the host takes requests once its engines are restored
        self._ops: list[tuple[str, str | None]] = []  # (request_id, key_id) to take, in order
        self._taking: asyncio.Task | None = None
        self._models_changed = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        handlers = {
            DONE: self._on_done,
            CALLS_DONE: self._on_calls_done,
            ENDED: self._on_ended,
            MODELS: self._on_models,
            PROGRESS: self._on_progress,
        }
        if self.host:
            handlers |= {OPS: self._on_ops, CALLS: self._on_calls}
        self.listener = Listener(
            state.store.url, notify.me, handlers, on_connect=self.catch_up, host_lock=self.host
        )

    # ---- lifetime ----
    async def listen(self) -> None:
        """Start listening (the host: and take the host's lock); notifications of requests
        wait until `open`."""
        await self.listener.start()

    async def announce(self) -> None:
        """The host: write the facts of its served models, for the frontends."""
        facts = [facts_row(e.facts) for e in self.state.engines.all()]

        def write(conn: Connection) -> None:
            for row in facts:
                queries.announce_model(conn, row)
            self.notify.models(conn)

        await self.state.journal.run(write)

    async def join(self) -> None:
        """A frontend: wait until the host has announced every model this one serves, then
        hold a ForwardEngine for each."""
        wanted = list(self.state.config.models)
        while True:
            self._models_changed.clear()
            found = await self.state.journal.run(queries.served_models)
            missing = [name for name in wanted if name not in found]
            if not missing:
                break
            log.info("waiting for the engine host to serve %s", ", ".join(missing))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._models_changed.wait(), WAITING_LOG_S)
        for name in wanted:
            self.state.engines.add(ForwardEngine(facts_of(found[name]), self.calls))
        log.info("frontend of the engine host for %s", ", ".join(wanted))

    async def open(self) -> None:
        """Serve: requests filed elsewhere are taken from now on (what was filed before is
        found by the catch-up)."""
        self._open = True
        await self.catch_up()

    async def stop(self) -> None:
        await self.listener.stop()
        for task in list(self._tasks):
            task.cancel()

    async def keep_seen(self) -> None:
        """Write the signs of life this process saw, every few seconds (a task)."""
        period = min(SEEN_EVERY_S, self.state.config.heartbeat_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            try:
                await self.state.sessions.flush_seen()
            except Exception:
                log.exception("writing signs of life")

    async def catch_up(self) -> None:
        """Read again what notifications would have said (at start, after a reconnect)."""
        if self.host and self._open:
            pending = await self.state.journal.run(queries.pending_request_ids)
            self._queue_ops([(rid, None) for rid in pending])
            for call_id in await self.state.journal.run(queries.pending_call_ids):
                self._spawn(self._run_call(call_id))
        self.state.futures.recheck()
        self.calls.catch_up()
        cached = self.state.sessions.cached()
        if cached:
            statuses = await self.state.journal.run(
                functools.partial(queries.session_statuses, session_ids=cached)
            )
            for sid, status in statuses.items():
                if status != "active":
                    self._spawn(self.state.session_ended_elsewhere(sid, status))

    # ---- every process ----
    def _on_done(self, body: str) -> None:
        self.state.futures.resolve_elsewhere(body.split())

    def _on_calls_done(self, body: str) -> None:
        self.calls.answered(body.split())

    def _on_ended(self, body: str) -> None:
        for item in body.split():
            what, _, rest = item.partition(":")
            if what == "session":
                session_id, _, status = rest.partition(":")
                self._spawn(self.state.session_ended_elsewhere(session_id, status))
            elif what == "model":
                self._spawn(self.state.models.unloaded_elsewhere(rest))

    def _on_models(self, body: str) -> None:
        self._models_changed.set()

    def _on_progress(self, body: str) -> None:
        self.state.futures.progress(decode_progress(body))

    # ---- the engine host: requests filed elsewhere ----
    def _on_ops(self, body: str) -> None:
        items = [item.partition(":") for item in body.split()]
        self._queue_ops([(rid, key_id or None) for rid, _, key_id in items])

    def _queue_ops(self, items: list[tuple[str, str | None]]) -> None:
        self._ops.extend(items)
        if self._open and self._ops and (self._taking is None or self._taking.done()):
            self._taking = self._spawn(self._take_all())

    async def _take_all(self) -> None:
        """Take the requests notified, in the order they were (one read per batch)."""
        while self._ops:
            batch, self._ops = self._ops, []
            ids = [rid for rid, _ in batch]
            rows = await self.state.journal.run(
                functools.partial(queries.requests_by_id, request_ids=ids)
            )
            for rid, key_id in batch:
                row = rows.get(rid)
                if row is not None and row["status"] == "pending":
                    try:
                        await self._take(row, key_id)
                    except Exception:
                        log.exception("taking request %s", rid)

    async def _take(self, row: dict[str, Any], key_id: str | None) -> None:
        state, rid = self.state, row["request_id"]
        claims = state.futures.claims
        assert claims is not None
        if not claims.take(rid):
            return  # handed to the engine already (recovery, or an earlier notification)
        try:
            engine, op = await self._op_of(row)
        except Exception as e:  # noqa: BLE001 - the request fails, as any refused one does
            state.futures.finish([Outcome.failed(rid, e)])
            return
        if state.futures.metrics is not None:  # the console's figures: where results finish
            state.futures.metrics.filed(op, row, key_id=key_id)
        if isinstance(op.payload, Sample) and op.payload.stream:
            state.futures.relayed.add(rid)  # its reader is in the process that filed it
        engine.submit(op)

    async def _op_of(self, row: dict[str, Any]) -> tuple[EngineClient, Op]:
        """The op of a request row, checked as its engine's own edge would."""
        engine = self.state.engines.get(row["base_model"])
        if engine is None:
            raise NotFoundError(f"base_model {row['base_model']!r} is not served here")
        if row["payload"] is None:
            raise TreadleError("the request was filed without its payload; send it again")
        kind = OpKind(row["kind"])
        payload = decode_payload(kind, row["payload"])
        op = Op(row["request_id"], kind, payload, row["model_id"], row["seq_id"])
        op.encoded = row["payload"]
        if kind == OpKind.SAMPLE:
            assert isinstance(op.payload, Sample)
            ref = op.payload.request.adapter
            if ref is not None and not engine.is_live(ref) and not engine.has_model(ref):
                raise NotFoundError(
                    f"sampling_session_id {row['sampling_session_id']!r}: its weights were "
                    "freed from memory (too many newer samplers of the same model); save a "
                    "new sampler"
                )
            return engine, op
        if not engine.has_model(op.model_id) and not await self.state.models.adopt(op.model_id):
            raise NotFoundError(f"model {op.model_id!r} was unloaded")
        engine.check_seq(op.model_id, op.seq_id)
        return engine, op

    # ---- the engine host: control calls of other processes ----
    def _on_calls(self, body: str) -> None:
        for call_id in body.split():
            self._spawn(self._run_call(call_id))

    async def _run_call(self, call_id: str) -> None:
        journal = self.state.journal
        row = await journal.run(functools.partial(queries.claim_call, call_id=call_id))
        if row is None:
            return  # taken already
        error = None
        try:
            engine = self.state.engines.require(row["base_model"])
            if row["name"] not in CONTROL_CALLS:
                raise InvalidRequestError(f"unknown control call {row['name']!r}")
            await getattr(engine, row["name"])(**row["args"])
        except Exception as e:  # noqa: BLE001 - the caller raises it
            error = error_record(e)

        def write(conn: Connection) -> None:
            queries.finish_call(conn, call_id, error)
            self.notify.call_done(conn, call_id)

        await journal.run(write)

    def _spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done_task)
        return task

    def _done_task(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("a notification's work failed", exc_info=task.exception())
