"""The schema's migrations on SQLite and PostgreSQL: an empty database is brought to head and
then matches the ORM rows exactly; a database made before the migrations (by `create_all`,
with 32-bit counters and without the columns added later) is adopted without losing a row;
a request of an older database gets the key its op record names; API processes starting at
once on one PostgreSQL database migrate it once.

    .venv/bin/python -m pytest -q tests/server/storage/test_migrations.py
"""

from __future__ import annotations

import datetime as dt
import threading

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import (
    BigInteger,
    Index,
    Integer,
    MetaData,
    Table,
    UniqueConstraint,
    create_engine,
    inspect,
    select,
    text,
)

from treadle.server.storage import migrations
from treadle.server.storage.database import Store, engine_url
from treadle.server.storage.queries import insert_request
from treadle.server.storage.rows import Base, CheckpointRow, RequestRow, SessionRow

BIG = 2**40  # beyond a 32-bit INTEGER


def differences(store: Store) -> list:
    with store.engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True})
        return compare_metadata(ctx, Base.metadata)


def test_an_empty_database_is_upgraded_to_head(db_url):
    store = Store(db_url)
    try:
        with store.engine.connect() as conn:
            assert migrations.current(conn) == migrations.head()
        assert differences(store) == []  # the revisions build exactly what rows.py declares
        with store.engine.begin() as conn:  # the counters hold int64
            insert_request(conn, {"request_id": "r1", "kind": "forward", "seq_id": BIG})
        assert store.get(RequestRow, "r1").seq_id == BIG
    finally:
        store.close()
    Store(db_url).close()  # opening it again finds nothing to do


def legacy_database(url: str) -> None:
    """A database as `create_all` made it before the migrations, from an older version
    still: INTEGER counters, no tenant_id on sessions, no payload or base_model on requests,
    no op_records table; a few rows in it."""
    initial = migrations.revision(migrations.FIRST).schema()
    dropped = {("sessions", "tenant_id"), ("requests", "payload"), ("requests", "base_model")}
    metadata = MetaData()
    for table in initial.sorted_tables:
        if table.name == "op_records":
            continue
        columns = []
        for column in table.columns:
            if (table.name, column.name) not in dropped:
                columns.append(column._copy())
                if isinstance(column.type, BigInteger):
                    columns[-1].type = Integer()
        extra = [
            UniqueConstraint(*(c.name for c in con.columns))
            for con in table.constraints
            if isinstance(con, UniqueConstraint) and len(con.columns) > 1
        ]
        extra += [
            Index(ix.name, *(c.name for c in ix.columns))
            for ix in table.indexes
            if len(ix.columns) > 1
        ]
        Table(table.name, metadata, *columns, *extra)
    engine = create_engine(engine_url(url))
    now = dt.datetime.now(dt.UTC)
    with engine.begin() as conn:
        metadata.create_all(conn)
        t = metadata.tables
        conn.execute(
            t["sessions"].insert(),
            {"session_id": "s1", "status": "active", "tags": [], "created_at": now},
        )
        conn.execute(
            t["requests"].insert(),
            {
                "request_id": "r1",
                "kind": "optim_step",
                "tenant_id": "default",
                "session_id": "s1",
                "model_id": "s1:train:0",
                "seq_id": 7,
                "dedup_key": "s1:train:0#7",
                "status": "done",
                "prompt_tokens": 0,
                "sampled_tokens": 0,
                "train_tokens": 12,
                "created_at": now,
            },
        )
        conn.execute(
            t["checkpoints"].insert(),
            {
                "tinker_path": "tinker://run/weights/a",
                "run_id": "run",
                "tenant_id": "default",
                "model_id": "s1:train:0",
                "checkpoint_type": "training",
                "name": "a",
                "dir": "/x",
                "base_model": "m",
                "lora_config": {"rank": 8},
                "size_bytes": 123,
                "created_at": now,
            },
        )
    engine.dispose()


def test_a_database_made_before_the_migrations_is_adopted(db_url):
    legacy_database(db_url)
    store = Store(db_url)
    try:
        with store.engine.connect() as conn:
            assert migrations.current(conn) == migrations.head()
        session = store.get(SessionRow, "s1")
        assert session.status == "active" and session.tenant_id == "default"
        request = store.get(RequestRow, "r1")
        assert (request.seq_id, request.train_tokens, request.payload) == (7, 12, None)
        assert store.get(CheckpointRow, "tinker://run/weights/a").size_bytes == 123
        found = inspect(store.engine)
        assert "op_records" in found.get_table_names()  # made, with its indexes
        assert {"ix_op_records_tenant_finished"} <= {
            ix["name"] for ix in found.get_indexes("op_records")
        }
        assert "last_seen_at" in {c["name"] for c in found.get_columns("sessions")}  # 0002
        # the 32-bit counters were widened (PostgreSQL; SQLite's INTEGER holds 64 bits)
        with store.engine.begin() as conn:
            conn.execute(
                text("UPDATE requests SET seq_id = :big, train_tokens = :big"), {"big": BIG}
            )
            seq = conn.execute(select(RequestRow.__table__.c.seq_id)).scalar_one()
        assert seq == BIG
    finally:
        store.close()


def test_requests_of_an_older_database_get_the_key_their_op_record_names(db_url):
    # a database at 0004: the key a request was sent with was kept by the console only
    engine = create_engine(engine_url(db_url))
    with engine.begin() as conn:
        command.upgrade(migrations.config(conn), "0004")
        now = dt.datetime.now(dt.UTC)
        for rid, kid in (("r1", "tml-keyA"), ("r2", None), ("r3", None)):
            conn.execute(
                text(
                    "INSERT INTO requests (request_id, kind, tenant_id, status, prompt_tokens,"
                    " sampled_tokens, train_tokens, created_at) VALUES (:rid, 'sample', 't',"
                    " 'done', 1, 2, 0, :now)"
                ),
                {"rid": rid, "now": now},
            )
            if rid != "r3":  # r3: recorded by no console
                conn.execute(
                    text(
                        "INSERT INTO op_records (request_id, tenant_id, key_id, kind, status,"
                        " queued_at, finished_at, batch_ops, prompt_tokens, sampled_tokens,"
                        " train_tokens) VALUES (:rid, 't', :kid, 'sample', 'done', 0, 1, 1,"
                        " 1, 2, 0)"
                    ),
                    {"rid": rid, "kid": kid},
                )
    engine.dispose()
    store = Store(db_url)  # → head
    try:
        keys = {rid: store.get(RequestRow, rid).key_id for rid in ("r1", "r2", "r3")}
        assert keys == {"r1": "tml-keyA", "r2": None, "r3": None}
    finally:
        store.close()


def test_processes_starting_at_once_migrate_once(pg_url):
    errors: list[BaseException] = []

    def open_store() -> None:
        try:
            Store(pg_url).close()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=open_store) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    store = Store(pg_url)
    try:
        assert differences(store) == []
    finally:
        store.close()
