"""Database rows (SQLAlchemy 2), the Store that reads and writes them, and the Core
statements of the hot path.

The database is for durability, not signalling: the API and the engine loop wake each other
through in-process events (treadle.server.notifier). SQLite under data_dir by default; any
SQLAlchemy URL works. Every Store method opens its own short session, so any thread may use
it; the request rows of the hot path (a submit, a result) are written by the journal thread
(treadle.server.journal) with the Core functions at the end of this file.

Durability: SQLite runs in WAL mode with synchronous=NORMAL. A commit has reached the
operating system before it returns, so it survives a crash of the server process (what
"nothing acknowledged is lost" needs); only a power cut or kernel crash can lose the last
commits before a checkpoint. FULL would add an fsync to every commit.
"""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

from sqlalchemy import (
    JSON,
    Connection,
    DateTime,
    Integer,
    LargeBinary,
    String,
    UniqueConstraint,
    bindparam,
    create_engine,
    event,
    func,
    insert,
    inspect,
    select,
    text,
    update,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker

DEFAULT_TENANT_ID = "default"  # the development tenant (treadle.server.auth.DEV_TENANT)


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def new_id() -> str:
    return uuid.uuid4().hex[:16]


class Base(DeclarativeBase):
    pass


class SessionRow(Base):
    __tablename__ = "sessions"
    session_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(64), default=DEFAULT_TENANT_ID, index=True)
    status: Mapped[str] = mapped_column(String(16), default="active")  # active|finished|expired
    tags: Mapped[list] = mapped_column(JSON, default=list)
    user_metadata: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    display_name: Mapped[str | None] = mapped_column(String(256), nullable=True)
    sdk_version: Mapped[str | None] = mapped_column(String(32), nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    ended_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class ModelRow(Base):
    """A training model (one LoRA adapter) and its training run."""

    __tablename__ = "models"
    model_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    run_id: Mapped[str] = mapped_column(String(64), unique=True)
    session_id: Mapped[str] = mapped_column(String(64), index=True)
    tenant_id: Mapped[str] = mapped_column(String(64), default=DEFAULT_TENANT_ID, index=True)
    base_model: Mapped[str] = mapped_column(String(256))
    lora_config: Mapped[dict] = mapped_column(JSON)
    user_metadata: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    status: Mapped[str] = mapped_column(String(16), default="active")  # active|unloaded
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    last_request_time: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class RequestRow(Base):
    """One future: what was asked, and its result (JSON or protobuf bytes) or error."""

    __tablename__ = "requests"
    request_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    kind: Mapped[str] = mapped_column(String(32))
    tenant_id: Mapped[str] = mapped_column(String(64), default=DEFAULT_TENANT_ID, index=True)
    # the served model that ran it: the price table is per base model
    base_model: Mapped[str | None] = mapped_column(String(256), nullable=True)
    session_id: Mapped[str | None] = mapped_column(String(64), nullable=True, index=True)
    model_id: Mapped[str | None] = mapped_column(String(128), nullable=True)
    sampling_session_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    seq_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # "<model_id>#<seq_id>" or "<sampling_session_id>#<seq_id>": a resubmission finds its row.
    dedup_key: Mapped[str | None] = mapped_column(String(256), unique=True, nullable=True)
    status: Mapped[str] = mapped_column(String(16), default="pending")  # pending|done|failed
    result: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    content_type: Mapped[str | None] = mapped_column(String(64), nullable=True)
    error: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    # Metered usage (treadle.server.metering): prefill, sample and train tokens.
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    sampled_tokens: Mapped[int] = mapped_column(Integer, default=0)
    train_tokens: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    finished_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class SamplingSessionRow(Base):
    __tablename__ = "sampling_sessions"
    __table_args__ = (UniqueConstraint("session_id", "seq_id"),)
    sampling_session_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    session_id: Mapped[str] = mapped_column(String(64), index=True)
    tenant_id: Mapped[str] = mapped_column(String(64), default=DEFAULT_TENANT_ID, index=True)
    seq_id: Mapped[int] = mapped_column(Integer)
    base_model: Mapped[str] = mapped_column(String(256))
    model_path: Mapped[str | None] = mapped_column(String(512), nullable=True)
    model_id: Mapped[str | None] = mapped_column(String(128), nullable=True)
    # the engine id sampled from: a snapshot id, a loaded adapter id, or None for the base
    engine_ref: Mapped[str | None] = mapped_column(String(256), nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class CheckpointRow(Base):
    __tablename__ = "checkpoints"
    tinker_path: Mapped[str] = mapped_column(String(512), primary_key=True)
    run_id: Mapped[str] = mapped_column(String(64), index=True)
    tenant_id: Mapped[str] = mapped_column(String(64), default=DEFAULT_TENANT_ID, index=True)
    model_id: Mapped[str] = mapped_column(String(128))
    checkpoint_type: Mapped[str] = mapped_column(String(16))  # training|sampler
    name: Mapped[str] = mapped_column(String(256))
    dir: Mapped[str] = mapped_column(String(1024))
    base_model: Mapped[str] = mapped_column(String(256))
    lora_config: Mapped[dict] = mapped_column(JSON)
    size_bytes: Mapped[int | None] = mapped_column(Integer, nullable=True)
    user_metadata: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class TenantRow(Base):
    """A customer or team. Its quotas override the config file's, field by field."""

    __tablename__ = "tenants"
    tenant_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    quotas: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class ApiKeyRow(Base):
    """An API key, stored as the sha256 of the key: the key itself is shown once."""

    __tablename__ = "api_keys"
    key_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    key_id: Mapped[str] = mapped_column(String(32), unique=True)  # the key's public prefix
    tenant_id: Mapped[str] = mapped_column(String(64), index=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    revoked_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


# Tables whose rows belong to a tenant (a tenant_id column); databases written before
# tenants existed get the column on open, their rows going to the development tenant.
TENANT_TABLES = ("sessions", "models", "requests", "sampling_sessions", "checkpoints")


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

    def fail_unfinished(self, message: str) -> int:
        """At startup: futures left pending by a previous process can never complete."""
        with self.session.begin() as s:
            result = s.execute(
                update(RequestRow)
                .where(RequestRow.status == "pending")
                .values(
                    status="failed",
                    error={"error": message, "category": "server"},
                    finished_at=utcnow(),
                )
            )
            return int(result.rowcount or 0)


# ---- the hot path, in Core: no ORM session, no identity map, one statement each ----

REQUESTS = RequestRow.__table__
# The columns an outcome sets; every outcome fills all of them so that one executemany
# statement writes a whole round of results.
OUTCOME_COLUMNS = (
    "status",
    "result",
    "content_type",
    "error",
    "prompt_tokens",
    "sampled_tokens",
    "train_tokens",
)
_FINISH = (
    update(REQUESTS)
    .where(REQUESTS.c.request_id == bindparam("rid"))
    .values({c: bindparam(c) for c in (*OUTCOME_COLUMNS, "finished_at")})
)


def insert_row(conn: Connection, cls: type[Base], values: dict[str, Any]) -> None:
    """One INSERT of a row given as column values (column defaults apply)."""
    conn.execute(insert(cls.__table__), values)


def finish_requests(conn: Connection, outcomes: list[dict[str, Any]]) -> None:
    """Write the outcomes (request_id plus columns) of finished requests."""
    now = utcnow()
    conn.execute(
        _FINISH,
        [
            {
                "rid": o["request_id"],
                "status": o["status"],
                "result": o.get("result"),
                "content_type": o.get("content_type"),
                "error": o.get("error"),
                "prompt_tokens": o.get("prompt_tokens", 0),
                "sampled_tokens": o.get("sampled_tokens", 0),
                "train_tokens": o.get("train_tokens", 0),
                "finished_at": now,
            }
            for o in outcomes
        ],
    )


def request_id_of(conn: Connection, dedup_key: str) -> str | None:
    """The request already filed under a dedup key, if any."""
    stmt = select(REQUESTS.c.request_id).where(REQUESTS.c.dedup_key == dedup_key)
    return conn.execute(stmt).scalar_one_or_none()


def request_row(conn: Connection, request_id: str) -> dict[str, Any] | None:
    """A request's columns as a dict (for futures this process no longer holds in memory)."""
    row = conn.execute(select(REQUESTS).where(REQUESTS.c.request_id == request_id)).first()
    return dict(row._mapping) if row is not None else None


def insert_request(conn: Connection, values: dict[str, Any]) -> str:
    """File a future; → its request_id."""
    insert_row(conn, RequestRow, values)
    return values["request_id"]


def sampling_session_id_of(conn: Connection, key: tuple[str, int]) -> str | None:
    """The sampling session already made for (session_id, sampling_session_seq_id)."""
    table = SamplingSessionRow.__table__
    stmt = select(table.c.sampling_session_id).where(
        (table.c.session_id == key[0]) & (table.c.seq_id == key[1])
    )
    return conn.execute(stmt).scalar_one_or_none()


def mark_session_ended(conn: Connection, session_id: str, status: str) -> tuple[list, list]:
    """Mark a session and its models ended; → its (model_id, base_model) and its
    (sampling_session_id, base_model, engine_ref)."""
    sessions, models = SessionRow.__table__, ModelRow.__table__
    samplers = SamplingSessionRow.__table__
    conn.execute(
        update(sessions)
        .where(sessions.c.session_id == session_id)
        .values(status=status, ended_at=utcnow())
    )
    mine = models.c.session_id == session_id
    model_rows = conn.execute(select(models.c.model_id, models.c.base_model).where(mine)).all()
    conn.execute(update(models).where(mine).values(status="unloaded"))
    sampler_rows = conn.execute(
        select(samplers.c.sampling_session_id, samplers.c.base_model, samplers.c.engine_ref).where(
            samplers.c.session_id == session_id
        )
    ).all()
    return [tuple(r) for r in model_rows], [tuple(r) for r in sampler_rows]


def set_model_status(conn: Connection, model_id: str, status: str) -> None:
    """active | unloaded."""
    models = ModelRow.__table__
    conn.execute(update(models).where(models.c.model_id == model_id).values(status=status))


def _add_missing_columns(engine: Any) -> None:
    """Columns added since a database was made (CREATE TABLE never alters a table)."""
    added = {
        **{(t, "tenant_id"): f"VARCHAR(64) DEFAULT '{DEFAULT_TENANT_ID}'" for t in TENANT_TABLES},
        ("requests", "base_model"): "VARCHAR(256)",
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
