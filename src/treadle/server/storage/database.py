"""The Store: the database connection, its schema, and short ORM reads and writes.

The database is for durability, not signalling: the API and the engines wake each other
through in-process events and the workers' sockets, never through rows. SQLite under
data_dir by default; PostgreSQL with `--db postgresql://user@host/db`. Opening a Store brings
the schema to the newest revision (treadle.server.storage.migrations). Every Store method
opens its own short session, so any thread may use it; the request rows of the hot path (a
submit, a result) are written by the journal thread (treadle.server.storage.journal) with
the Core statements of treadle.server.storage.queries.

Durability: SQLite runs in WAL mode with synchronous=NORMAL. A commit has reached the
operating system before it returns, so it survives a crash of the server process (what
"nothing acknowledged is lost" needs); only a power cut or kernel crash can lose the last
commits before a checkpoint. FULL would add an fsync to every commit. PostgreSQL keeps its
own settings (synchronous_commit on by default: a commit is on disk).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import create_engine, event, func, select, update
from sqlalchemy.orm import sessionmaker

from treadle.server.storage import migrations
from treadle.server.storage.rows import Base


def engine_url(url: str) -> str:
    """A URL as given → the one SQLAlchemy opens: PostgreSQL through psycopg (version 3),
    whatever driver SQLAlchemy would pick for a bare postgresql://."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url.removeprefix(prefix)
    return url


class Store:
    def __init__(self, url: str):
        self.url = engine_url(url)
        is_sqlite = self.url.startswith("sqlite")
        self.engine = create_engine(
            self.url, connect_args={"check_same_thread": False} if is_sqlite else {}
        )
        if is_sqlite:
            event.listen(self.engine, "connect", _sqlite_pragmas)
        migrations.upgrade(self.engine)
        self.session = sessionmaker(self.engine, expire_on_commit=False)

    def close(self) -> None:
        self.engine.dispose()

    # ---- generic ----
    def add(self, row: Base) -> None:
        with self.session.begin() as s:
            s.add(row)

    def get(self, cls: type, key: Any) -> Any:
        with self.session() as s:
            return s.get(cls, key)

    def set(self, cls: type, key: Any, **values: Any) -> None:
        pk = cls.__mapper__.primary_key[0]
        with self.session.begin() as s:
            s.execute(update(cls).where(pk == key).values(**values))

    def query(self, stmt) -> list:
        with self.session() as s:
            return list(s.scalars(stmt))

    def count(self, stmt) -> int:
        with self.session() as s:
            return int(s.scalar(select(func.count()).select_from(stmt.subquery())))


def _sqlite_pragmas(dbapi_conn, _record) -> None:
    # WAL lets the API read while an engine thread writes; NORMAL sync survives a process
    # crash (not a power cut) at a fraction of FULL's cost per commit.
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA busy_timeout=5000")
    cur.close()
