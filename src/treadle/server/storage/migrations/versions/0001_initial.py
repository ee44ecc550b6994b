"""The initial schema: the tables as they were when Alembic took over the schema.

The tables are a frozen copy (`schema()`), never the ORM rows of today: a later change of
treadle.server.storage.rows comes with a revision of its own. The same copy brings a
database made before the migrations (by `create_all`, tables and no alembic_version) to this
revision's shape (`adopt`), which is then stamped.

Revision ID: 0001
Revises:
"""

from __future__ import annotations

from alembic import op
from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    Connection,
    DateTime,
    Float,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    UniqueConstraint,
    inspect,
)

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

# step_figures.id: BIGSERIAL on PostgreSQL; SQLite numbers only an INTEGER PRIMARY KEY itself
BIG_ID = BigInteger().with_variant(Integer, "sqlite")


def schema() -> MetaData:
    """Every table of this revision."""
    metadata = MetaData()
    Table(
        "admin_keys",
        metadata,
        Column("key_hash", String(64), primary_key=True),
        Column("created_at", DateTime(timezone=True), nullable=False),
    )
    Table(
        "api_keys",
        metadata,
        Column("key_hash", String(64), primary_key=True),
        Column("key_id", String(32), nullable=False, unique=True),
        Column("tenant_id", String(64), nullable=False, index=True),
        Column("created_at", DateTime(timezone=True), nullable=False),
        Column("revoked_at", DateTime(timezone=True), nullable=True),
    )
    Table(
        "checkpoints",
        metadata,
        Column("tinker_path", String(512), primary_key=True),
        Column("run_id", String(64), nullable=False, index=True),
        Column("tenant_id", String(64), nullable=False, index=True),
        Column("model_id", String(128), nullable=False),
        Column("checkpoint_type", String(16), nullable=False),
        Column("name", String(256), nullable=False),
        Column("dir", String(1024), nullable=False),
        Column("base_model", String(256), nullable=False),
        Column("lora_config", JSON, nullable=False),
        Column("size_bytes", BigInteger, nullable=True),
        Column("user_metadata", JSON, nullable=True),
        Column("created_at", DateTime(timezone=True), nullable=False),
    )
    Table(
        "model_packages",
        metadata,
        Column("model_id", String(128), primary_key=True),
        Column("tenant_id", String(64), nullable=False, index=True),
        Column("group_name", String(64), nullable=False),
        Column("output_path", String(1024), nullable=True),
    )
    Table(
        "models",
        metadata,
        Column("model_id", String(128), primary_key=True),
        Column("run_id", String(64), nullable=False, unique=True),
        Column("session_id", String(64), nullable=False, index=True),
        Column("tenant_id", String(64), nullable=False, index=True),
        Column("base_model", String(256), nullable=False),
        Column("lora_config", JSON, nullable=False),
        Column("user_metadata", JSON, nullable=True),
        Column("status", String(16), nullable=False),
        Column("created_at", DateTime(timezone=True), nullable=False),
        Column("last_request_time", DateTime(timezone=True), nullable=False),
    )
    Table(
        "op_records",
        metadata,
        Column("request_id", String(64), primary_key=True),
        Column("tenant_id", String(64), nullable=False),
        Column("key_id", String(32), nullable=True),
        Column("session_id", String(64), nullable=True, index=True),
        Column("model_id", String(128), nullable=True),
        Column("base_model", String(256), nullable=True),
        Column("kind", String(32), nullable=False),
        Column("status", String(16), nullable=False),
        Column("error", String(512), nullable=True),
        Column("queued_at", Float, nullable=False),
        Column("started_at", Float, nullable=True),
        Column("finished_at", Float, nullable=False, index=True),
        Column("batch_ops", Integer, nullable=False),
        Column("step", BigInteger, nullable=True),
        Column("prompt_tokens", BigInteger, nullable=False),
        Column("sampled_tokens", BigInteger, nullable=False),
        Column("train_tokens", BigInteger, nullable=False),
        Index("ix_op_records_tenant_finished", "tenant_id", "finished_at"),
    )
    Table(
        "package_groups",
        metadata,
        Column("id", String(64), primary_key=True),
        Column("tenant_id", String(64), nullable=False, index=True),
        Column("name", String(64), nullable=False),
        Column("keep_last", Integer, nullable=True),
        Column("state_ttl_s", Float, nullable=True),
        Column("created_at", DateTime(timezone=True), nullable=False),
        UniqueConstraint("tenant_id", "name"),
    )
    Table(
        "package_versions",
        metadata,
        Column("id", String(64), primary_key=True),
        Column("tenant_id", String(64), nullable=False, index=True),
        Column("group_name", String(64), nullable=False),
        Column("version", Integer, nullable=False),
        Column("kind", String(16), nullable=False),
        Column("name", String(256), nullable=True),
        Column("session_id", String(64), nullable=True),
        Column("model_id", String(128), nullable=True),
        Column("run_id", String(64), nullable=True),
        Column("base_model", String(256), nullable=False),
        Column("lora_config", JSON, nullable=True),
        Column("step", BigInteger, nullable=True),
        Column("size_bytes", BigInteger, nullable=False),
        Column("user_metadata", JSON, nullable=True),
        Column("location", String(1024), nullable=False),
        Column("tinker_path", String(512), nullable=True),
        Column("encrypted", Boolean, nullable=False),
        Column("key_id", String(32), nullable=True),
        Column("source", String(512), nullable=True),
        Column("created_at", DateTime(timezone=True), nullable=False),
        UniqueConstraint("tenant_id", "group_name", "version"),
    )
    Table(
        "requests",
        metadata,
        Column("request_id", String(64), primary_key=True),
        Column("kind", String(32), nullable=False),
        Column("tenant_id", String(64), nullable=False, index=True),
        Column("base_model", String(256), nullable=True),
        Column("session_id", String(64), nullable=True, index=True),
        Column("model_id", String(128), nullable=True),
        Column("sampling_session_id", String(64), nullable=True),
        Column("seq_id", BigInteger, nullable=True),
        Column("dedup_key", String(256), nullable=True, unique=True),
        Column("payload", LargeBinary, nullable=True),
        Column("status", String(16), nullable=False),
        Column("result", LargeBinary, nullable=True),
        Column("content_type", String(64), nullable=True),
        Column("error", JSON, nullable=True),
        Column("prompt_tokens", BigInteger, nullable=False),
        Column("sampled_tokens", BigInteger, nullable=False),
        Column("train_tokens", BigInteger, nullable=False),
        Column("created_at", DateTime(timezone=True), nullable=False),
        Column("finished_at", DateTime(timezone=True), nullable=True),
        Index("ix_requests_model_seq", "model_id", "seq_id"),
    )
    Table(
        "sampled_sequences",
        metadata,
        Column("sequence_id", String(96), primary_key=True),
        Column("tenant_id", String(64), nullable=False, index=True),
        Column("session_id", String(64), nullable=False, index=True),
        Column("prompt", LargeBinary, nullable=False),
        Column("tokens", LargeBinary, nullable=False),
        Column("logprobs", LargeBinary, nullable=False),
        Column("created_at", DateTime(timezone=True), nullable=False),
        Column("expires_at", DateTime(timezone=True), nullable=False, index=True),
    )
    Table(
        "sampling_sessions",
        metadata,
        Column("sampling_session_id", String(64), primary_key=True),
        Column("session_id", String(64), nullable=False, index=True),
        Column("tenant_id", String(64), nullable=False, index=True),
        Column("seq_id", BigInteger, nullable=False),
        Column("base_model", String(256), nullable=False),
        Column("model_path", String(512), nullable=True),
        Column("model_id", String(128), nullable=True),
        Column("engine_ref", String(256), nullable=True),
        Column("created_at", DateTime(timezone=True), nullable=False),
        UniqueConstraint("session_id", "seq_id"),
    )
    Table(
        "sessions",
        metadata,
        Column("session_id", String(64), primary_key=True),
        Column("tenant_id", String(64), nullable=False, index=True),
        Column("status", String(16), nullable=False),
        Column("tags", JSON, nullable=False),
        Column("user_metadata", JSON, nullable=True),
        Column("display_name", String(256), nullable=True),
        Column("sdk_version", String(32), nullable=True),
        Column("created_at", DateTime(timezone=True), nullable=False),
        Column("ended_at", DateTime(timezone=True), nullable=True),
    )
    Table(
        "spend_caps",
        metadata,
        Column("id", String(64), primary_key=True),
        Column("tenant_id", String(64), nullable=False, index=True),
        Column("scope", String(64), nullable=False),
        Column("period", String(8), nullable=False),
        Column("max_tokens", BigInteger, nullable=True),
        Column("max_usd", Float, nullable=True),
        Column("created_at", DateTime(timezone=True), nullable=False),
        UniqueConstraint("tenant_id", "scope", "period"),
    )
    Table(
        "state_snapshots",
        metadata,
        Column("model_id", String(128), primary_key=True),
        Column("seq_id", BigInteger, nullable=False),
        Column("dir", String(1024), nullable=False),
        Column("samplers", JSON, nullable=False),
        Column("created_at", DateTime(timezone=True), nullable=False),
    )
    Table(
        "step_figures",
        metadata,
        Column("id", BIG_ID, primary_key=True, autoincrement=True),
        Column("tenant_id", String(64), nullable=False, index=True),
        Column("session_id", String(64), nullable=False),
        Column("model_id", String(128), nullable=False),
        Column("step", BigInteger, nullable=False),
        Column("name", String(128), nullable=False),
        Column("value", Float, nullable=False),
        Column("source", String(8), nullable=False),
        Column("at", Float, nullable=False),
        UniqueConstraint("model_id", "step", "name", "source"),
        Index("ix_step_figures_session_step", "session_id", "step"),
    )
    Table(
        "tenants",
        metadata,
        Column("tenant_id", String(64), primary_key=True),
        Column("name", String(128), nullable=False, unique=True),
        Column("quotas", JSON, nullable=True),
        Column("created_at", DateTime(timezone=True), nullable=False),
    )
    return metadata


def upgrade() -> None:
    schema().create_all(op.get_bind())


def downgrade() -> None:
    schema().drop_all(op.get_bind())


def adopt(conn: Connection) -> None:
    """A database made before the migrations → this revision's shape, rows kept: the
    tables it lacks are made, the columns added since (a tenant_id, a request's base_model
    and payload, ...) are added, missing indexes made, and on PostgreSQL 32-bit counters
    widened to BIGINT."""
    ops = op_of(conn)
    metadata = schema()
    metadata.create_all(conn)  # only the tables missing
    found = inspect(conn)
    for table in metadata.sorted_tables:
        have = {c["name"]: c for c in found.get_columns(table.name)}
        for column in table.columns:
            if column.name not in have:
                default = "default" if column.name == "tenant_id" else None
                ops.add_column(
                    table.name,
                    Column(column.name, column.type, nullable=True, server_default=default),
                )
            elif conn.dialect.name == "postgresql" and isinstance(column.type, BigInteger):
                found_type = have[column.name]["type"]
                if isinstance(found_type, Integer) and not isinstance(found_type, BigInteger):
                    ops.alter_column(
                        table.name, column.name, type_=BigInteger(), existing_type=Integer()
                    )
        indexes = {ix["name"] for ix in found.get_indexes(table.name)}
        for index in table.indexes:
            if index.name not in indexes:
                index.create(conn)


def op_of(conn: Connection):
    from alembic.migration import MigrationContext
    from alembic.operations import Operations

    return Operations(MigrationContext.configure(conn))
