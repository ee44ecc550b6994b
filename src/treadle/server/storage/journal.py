"""The journal: one thread that commits the hot path's database writes, in batches.

A submit's request row and a result's outcome are both written here, in the order they were
handed in, through one connection:
- the event loop never waits on the disk, and the engine thread never waits for a commit
  (it hands its outcomes over and starts the next round);
- SQLite never sees two writers of these rows (a second writer would sleep in its busy
  handler, a timer);
- every write queued while a commit is running joins the next transaction (group commit):
  under load one commit serves many calls, and a round of results is one transaction.

A write is a function of a Connection. Its value (or exception) is handed on only once the
transaction holding it has committed, never before: whatever a client is told is on disk.
A failing write does not sink the others of its batch: the batch is rolled back and its
writes are retried one transaction each.

    journal = Journal(store.engine); journal.start()
    await journal.run(lambda conn: insert_row(conn, RequestRow, values))   # on the event loop
    journal.submit(write, done)        # any thread; done(value, error) runs on the journal
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine

from treadle.server.observe.metrics import DB_COMMIT_SECONDS

log = logging.getLogger("treadle.journal")
T = TypeVar("T")

Write = Callable[[Connection], Any]
Done = Callable[[Any, BaseException | None], None]


class Journal:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._queue: deque[tuple[Write, Done]] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._conn: Connection | None = None  # the journal thread's own
        self._thread = threading.Thread(target=self._run, name="journal", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Commit what is queued, then end the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---- handing writes in (any thread) ----
    def submit(self, write: Write, done: Done) -> None:
        """Queue `write`; `done(value, error)` runs on the journal thread after the commit."""
        with self._cond:
            if self._stopping and not self._thread.is_alive():
                raise RuntimeError("the journal has stopped")
            self._queue.append((write, done))
            self._cond.notify()

    def run(
        self, write: Callable[[Connection], T], then: Callable[[T], None] | None = None
    ) -> asyncio.Future[T]:
        """From the event loop: a future of `write`'s value, resolved once committed.

        `then(value)` runs on the journal thread right after a successful commit, before the
        loop hears of it (e.g. hand the filed op to the engine thread directly).
        """
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()

        def done(value: Any, error: BaseException | None) -> None:
            if error is None and then is not None:
                try:
                    then(value)
                except Exception as e:
                    error = e
            if not loop.is_closed():
                loop.call_soon_threadsafe(_settle, fut, value, error)

        self.submit(write, done)
        return fut

    def call(self, write: Callable[[Connection], T], timeout: float | None = None) -> T:
        """From a thread other than the journal's: run `write` and wait for its commit."""
        box: dict[str, Any] = {}
        ready = threading.Event()

        def done(value: Any, error: BaseException | None) -> None:
            box["value"], box["error"] = value, error
            ready.set()

        self.submit(write, done)
        if not ready.wait(timeout):
            raise TimeoutError("the journal did not commit in time")
        if box["error"] is not None:
            raise box["error"]
        return box["value"]

    # ---- the journal thread ----
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._queue:  # stopping, and everything is written
                    if self._conn is not None:
                        self._conn.close()
                    return
                batch = list(self._queue)
                self._queue.clear()
            for (_, done), (value, error) in zip(batch, self._commit(batch), strict=True):
                try:
                    done(value, error)
                except Exception:
                    log.exception("journal callback failed")

    def _commit(self, batch: list[tuple[Write, Done]]) -> list[tuple[Any, BaseException | None]]:
        try:
            t0 = time.perf_counter()
            conn = self._connection()
            values = [write(conn) for write, _ in batch]
            conn.commit()
            DB_COMMIT_SECONDS.observe(time.perf_counter() - t0)  # the batch's transaction
            return [(v, None) for v in values]
        except Exception as e:
            self._rollback()
            if len(batch) == 1:
                return [(None, e)]
        # one write failed and took the transaction with it: each on its own now
        out: list[tuple[Any, BaseException | None]] = []
        for write, _ in batch:
            try:
                conn = self._connection()
                value = write(conn)
                conn.commit()
                out.append((value, None))
            except Exception as e:
                self._rollback()
                out.append((None, e))
        return out

    def _connection(self) -> Connection:
        # One connection for the thread's life: a pool checkout per batch costs as much as
        # the INSERT itself. A broken one is replaced (see _rollback).
        if self._conn is None:
            self._conn = self.engine.connect()
        return self._conn

    def _rollback(self) -> None:
        if self._conn is None:
            return
        try:
            self._conn.rollback()
        except Exception:
            log.warning("journal connection lost; reconnecting", exc_info=True)
            with contextlib.suppress(Exception):
                self._conn.close()
            self._conn = None


def _settle(fut: asyncio.Future, value: Any, error: BaseException | None) -> None:
    if fut.done():  # the awaiting request was cancelled (client gone)
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(value)
