"""The Store: the database connection, schema creation, and short ORM reads and writes.

The database is for durability, not signalling: the API and the engine loop wake each other
through in-process events (treadle.server.core.board). SQLite under data_dir by default; any
SQLAlchemy URL works. Every Store method opens its own short session, so any thread may use
it; the request rows of the hot path (a submit, a result) are written by the journal thread
(treadle.server.runtime.journal) with the Core statements of treadle.server.storage.queries.

Durability: SQLite runs in WAL mode with synchronous=NORMAL. A commit has reached the
operating system before it returns, so it survives a crash of the server process (what
"nothing acknowledged is lost" needs); only a power cut or kernel crash can lose the last
commits before a checkpoint. FULL would add an fsync to every commit.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import create_engine, event, func, inspect, select, text, update
from sqlalchemy.orm import sessionmaker

from treadle.server.storage.rows import DEFAULT_TENANT_ID, TENANT_TABLES, Base


class Store:
    def __init__(self, url: str):
        is_sqlite = url.startswith("sqlite")
        self.engine = create_engine(
            url, connect_args={"check_same_thread": False} if is_sqlite else {}
        )
        if is_sqlite:
            event.listen(self.engine, "connect", _sqlite_pragmas)
        Base.metadata.create_all(self.engine)
        _add_missing_columns(self.engine)
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



def _add_missing_columns(engine: Any) -> None:
    """Columns added since a database was made (CREATE TABLE never alters a table)."""
    added = {
        **{(t, "tenant_id"): f"VARCHAR(64) DEFAULT '{DEFAULT_TENANT_ID}'" for t in TENANT_TABLES},
        ("requests", "base_model"): "VARCHAR(256)",
        ("requests", "payload"): "BLOB",
    }
    have = {t: {c["name"] for c in inspect(engine).get_columns(t)} for t in TENANT_TABLES}
    with engine.begin() as conn:
        for (table, column), ddl in added.items():
            if column not in have[table]:
                conn.execute(text(f"ALTER TABLE {table} ADD COLUMN {column} {ddl}"))


def _sqlite_pragmas(dbapi_conn, _record) -> None:
    # WAL lets the API read while an engine thread writes; NORMAL sync survives a process
    # crash (not a power cut) at a fraction of FULL's cost per commit.
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA busy_timeout=5000")
    cur.close()
