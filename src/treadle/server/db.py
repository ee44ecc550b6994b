"""Database rows (SQLAlchemy 2) and the Store that reads and writes them.

The database is for durability, not signalling: the API and the engine loop wake each other
through in-process events (treadle.server.notifier). SQLite under data_dir by default; any
SQLAlchemy URL works. Every method opens its own short session, so the API thread and the
engine threads can share one Store.
"""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

from sqlalchemy import (
    JSON,
    DateTime,
    Integer,
    LargeBinary,
    String,
    UniqueConstraint,
    create_engine,
    event,
    func,
    select,
    update,
)
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def new_id() -> str:
    return uuid.uuid4().hex[:16]


class Base(DeclarativeBase):
    pass


class SessionRow(Base):
    __tablename__ = "sessions"
    session_id: Mapped[str] = mapped_column(String(64), primary_key=True)
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
    # Usage, recorded now so that metering (a later issue) has it.
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
    model_id: Mapped[str] = mapped_column(String(128))
    checkpoint_type: Mapped[str] = mapped_column(String(16))  # training|sampler
    name: Mapped[str] = mapped_column(String(256))
    dir: Mapped[str] = mapped_column(String(1024))
    base_model: Mapped[str] = mapped_column(String(256))
    lora_config: Mapped[dict] = mapped_column(JSON)
    size_bytes: Mapped[int | None] = mapped_column(Integer, nullable=True)
    user_metadata: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Store:
    def __init__(self, url: str):
        is_sqlite = url.startswith("sqlite")
        self.engine = create_engine(
            url, connect_args={"check_same_thread": False} if is_sqlite else {}
        )
        if is_sqlite:
            event.listen(self.engine, "connect", _sqlite_pragmas)
        Base.metadata.create_all(self.engine)
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

    # ---- requests ----
    def insert_request(self, row: RequestRow) -> tuple[RequestRow, bool]:
        """Insert a future, or return the one already filed under its dedup key.

        → (row, created).
        """
        if row.dedup_key is not None:
            existing = self.query(select(RequestRow).where(RequestRow.dedup_key == row.dedup_key))
            if existing:
                return existing[0], False
        try:
            self.add(row)
        except IntegrityError:
            existing = self.query(select(RequestRow).where(RequestRow.dedup_key == row.dedup_key))
            if not existing:
                raise
            return existing[0], False
        return row, True

    def finish_requests(self, outcomes: list[dict[str, Any]]) -> None:
        """Write results in one transaction; each outcome holds request_id and the columns."""
        now = utcnow()
        with self.session.begin() as s:
            for o in outcomes:
                values = {k: v for k, v in o.items() if k != "request_id"}
                s.execute(
                    update(RequestRow)
                    .where(RequestRow.request_id == o["request_id"])
                    .values(finished_at=now, **values)
                )

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


def _sqlite_pragmas(dbapi_conn, _record) -> None:
    # WAL lets the API read while an engine thread writes; NORMAL sync survives a process
    # crash (not a power cut) at a fraction of FULL's cost per commit.
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA busy_timeout=5000")
    cur.close()
