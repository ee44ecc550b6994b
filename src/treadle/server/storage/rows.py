"""The database schema: every ORM row of the server, in one place.

Every row that belongs to a tenant carries tenant_id (TENANT_TABLES); the API filters every
ORM read made while serving a request to the request's tenant (treadle.server.tenancy.auth).

The schema in the database is made and changed by the Alembic migrations next to this file
(treadle.server.storage.migrations): a change here needs a new revision there, and a test
checks that the two agree. Numbers that count (seq ids, tokens, sizes, steps) are BIGINT:
the edge accepts int64, and PostgreSQL's INTEGER holds 32 bits.
"""

from __future__ import annotations

import datetime as dt
import uuid

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

DEFAULT_TENANT_ID = "default"  # the development tenant (treadle.server.tenancy.auth.DEV_TENANT)


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
    # a label the tenant groups sessions by (create_session, assign_session_project)
    project_id: Mapped[str | None] = mapped_column(String(128), nullable=True, index=True)
    # The last sign of life any API process saw (several API processes on one database:
    # each writes what it saw every few seconds; the engine host's reaper reads it).
    last_seen_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


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
    # why the server unloaded it (it could not be restored after a restart); None when the
    # user or the session's end did: later requests hear it, later starts leave it alone
    unloaded_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    last_request_time: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # a run of no session's (a copy_weights copy): the project it was copied into
    project_id: Mapped[str | None] = mapped_column(String(128), nullable=True)


class RequestRow(Base):
    """One future: what was asked, and its result (JSON or protobuf bytes) or error."""

    __tablename__ = "requests"
    __table_args__ = (Index("ix_requests_model_seq", "model_id", "seq_id"),)
    request_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    kind: Mapped[str] = mapped_column(String(32))
    tenant_id: Mapped[str] = mapped_column(String(64), default=DEFAULT_TENANT_ID, index=True)
    # the public id of the API key it was sent with (per-key spend caps), if any
    key_id: Mapped[str | None] = mapped_column(String(32), nullable=True)
    # the served model that ran it: the price table is per base model
    base_model: Mapped[str | None] = mapped_column(String(256), nullable=True)
    session_id: Mapped[str | None] = mapped_column(String(64), nullable=True, index=True)
    model_id: Mapped[str | None] = mapped_column(String(128), nullable=True)
    sampling_session_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    seq_id: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    # "<model_id>#<seq_id>" or "<sampling_session_id>#<seq_id>": a resubmission finds its row.
    dedup_key: Mapped[str | None] = mapped_column(String(256), unique=True, nullable=True)
    # The op log: the op's payload (treadle.protocol.messages), written with the row,
    # before the client hears of it; recovery replays it. Cleared once a state snapshot of
    # its model covers it.
    payload: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    status: Mapped[str] = mapped_column(String(16), default="pending")  # pending|done|failed
    result: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    content_type: Mapped[str | None] = mapped_column(String(64), nullable=True)
    error: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    # Metered usage (treadle.server.tenancy.metering): prefill, sample and train tokens,
    # and prompt tokens the sampler's prefix cache held (not in prompt_tokens)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    sampled_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    train_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    cached_prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    finished_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class StateSnapshotRow(Base):
    """A training model's last state on disk (adapter, AdamW, step, accumulated gradients)
    after op `seq_id`, and its sampler snapshots then (engine id → folder)."""

    __tablename__ = "state_snapshots"
    model_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    seq_id: Mapped[int] = mapped_column(BigInteger)
    dir: Mapped[str] = mapped_column(String(1024))
    samplers: Mapped[dict] = mapped_column(JSON, default=dict)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class SamplingSessionRow(Base):
    __tablename__ = "sampling_sessions"
    __table_args__ = (UniqueConstraint("session_id", "seq_id"),)
    sampling_session_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    session_id: Mapped[str] = mapped_column(String(64), index=True)
    tenant_id: Mapped[str] = mapped_column(String(64), default=DEFAULT_TENANT_ID, index=True)
    seq_id: Mapped[int] = mapped_column(BigInteger)
    base_model: Mapped[str] = mapped_column(String(256))
    model_path: Mapped[str | None] = mapped_column(String(512), nullable=True)
    model_id: Mapped[str | None] = mapped_column(String(128), nullable=True)
    # the engine id sampled from: a snapshot id, a loaded adapter id, or None for the base
    engine_ref: Mapped[str | None] = mapped_column(String(256), nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # clients that joined it (join_sampling_session); the original client is 0
    clients: Mapped[int] = mapped_column(BigInteger, default=0)


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
    size_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    user_metadata: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # readable (sampled from, loaded, copied) by every tenant of the server
    public: Mapped[bool] = mapped_column(Boolean, default=False)
    # its TTL: the server deletes its files then (treadle.server.core.lifetime)
    expires_at: Mapped[dt.datetime | None] = mapped_column(
        DateTime(timezone=True), nullable=True, index=True
    )
    # when its files were deleted at expiry: the row stays to say so
    expired_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class CustomLossRow(Base):
    """A loss uploaded with create_custom_loss (its graph checked, then kept as uploaded):
    only forward_backward requests of its session may name it."""

    __tablename__ = "custom_losses"
    __table_args__ = (UniqueConstraint("session_id", "seq_id"),)
    loss_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(64), index=True)
    session_id: Mapped[str] = mapped_column(String(64))
    seq_id: Mapped[int] = mapped_column(BigInteger)
    name: Mapped[str] = mapped_column(String(128))
    upload: Mapped[str] = mapped_column(Text)  # JSON: name, inputs, graph
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class UploadRow(Base):
    """An external-weights upload in progress: the files it may receive, each through a
    signed single-use URL until `expires_at`, then the checkpoint it becomes."""

    __tablename__ = "uploads"
    upload_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(64), index=True)
    run_id: Mapped[str] = mapped_column(String(64))
    name: Mapped[str] = mapped_column(String(256))
    base_model: Mapped[str] = mapped_column(String(256))
    files: Mapped[dict] = mapped_column(JSON)  # file name → its declared size in bytes
    received: Mapped[list] = mapped_column(JSON, default=list)  # names received (single use)
    status: Mapped[str] = mapped_column(String(16), default="open")  # open | finished
    tinker_path: Mapped[str | None] = mapped_column(String(512), nullable=True)
    expires_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
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


class PackageGroupRow(Base):
    __tablename__ = "package_groups"
    __table_args__ = (UniqueConstraint("tenant_id", "name"),)
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(64), index=True)
    name: Mapped[str] = mapped_column(String(64))
    keep_last: Mapped[int | None] = mapped_column(Integer, nullable=True)
    """Sampler versions kept (per kind: sampler adapters, merged models); None keeps all."""
    state_ttl_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    """Training-state versions older than this are deleted; None keeps them."""
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class VersionRow(Base):
    __tablename__ = "package_versions"
    __table_args__ = (UniqueConstraint("tenant_id", "group_name", "version"),)
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(64), index=True)
    group_name: Mapped[str] = mapped_column(String(64))
    version: Mapped[int] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(16))  # sampler | merged | state
    name: Mapped[str | None] = mapped_column(String(256), nullable=True)
    session_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    model_id: Mapped[str | None] = mapped_column(String(128), nullable=True)
    run_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    base_model: Mapped[str] = mapped_column(String(256))
    lora_config: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    step: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    size_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    user_metadata: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    location: Mapped[str] = mapped_column(String(1024))
    """Where the files are: a server folder or s3://bucket/prefix/<tenant>/<group>/<id>."""
    tinker_path: Mapped[str | None] = mapped_column(String(512), nullable=True)
    encrypted: Mapped[bool] = mapped_column(Boolean, default=False)
    key_id: Mapped[str | None] = mapped_column(String(32), nullable=True)
    source: Mapped[str | None] = mapped_column(String(512), nullable=True)
    """Where an imported version came from (a folder name, a version reference)."""
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class ModelPackageRow(Base):
    """A training model's group binding: where its saves are published."""

    __tablename__ = "model_packages"
    model_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(64), index=True)
    group_name: Mapped[str] = mapped_column(String(64))
    output_path: Mapped[str | None] = mapped_column(String(1024), nullable=True)


class SampledSequenceRow(Base):
    """A sequence sampled with record_stability_info, kept for the training requests that
    name it in their provenance (treadle.server.core.sequences): its prompt, its tokens and
    the sampler's logprob of each, as little-endian int32 / float32 bytes."""

    __tablename__ = "sampled_sequences"
    sequence_id: Mapped[str] = mapped_column(String(96), primary_key=True)  # <request_id>:<i>
    tenant_id: Mapped[str] = mapped_column(String(64), index=True)
    session_id: Mapped[str] = mapped_column(String(64), index=True)
    prompt: Mapped[bytes] = mapped_column(LargeBinary)
    tokens: Mapped[bytes] = mapped_column(LargeBinary)
    logprobs: Mapped[bytes] = mapped_column(LargeBinary)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    expires_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), index=True)
    """Trainable until then; each training request that uses the sequence renews it."""


class OpRecordRow(Base):
    """One finished operation as the console's request timeline sees it (written with its
    result by treadle.server.console.recorder): when it was filed, when its engine call began
    and ended, what it metered, and the key that asked."""

    __tablename__ = "op_records"
    __table_args__ = (Index("ix_op_records_tenant_finished", "tenant_id", "finished_at"),)
    request_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(64), default=DEFAULT_TENANT_ID)
    key_id: Mapped[str | None] = mapped_column(String(32), nullable=True)
    session_id: Mapped[str | None] = mapped_column(String(64), nullable=True, index=True)
    model_id: Mapped[str | None] = mapped_column(String(128), nullable=True)
    base_model: Mapped[str | None] = mapped_column(String(256), nullable=True)
    kind: Mapped[str] = mapped_column(String(32))
    status: Mapped[str] = mapped_column(String(16))  # done | failed
    error: Mapped[str | None] = mapped_column(String(512), nullable=True)
    # wall-clock seconds (time.time()): filed, engine call began, result ready
    queued_at: Mapped[float] = mapped_column(Float)
    started_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    finished_at: Mapped[float] = mapped_column(Float, index=True)
    batch_ops: Mapped[int] = mapped_column(Integer, default=1)  # ops in the same engine call
    step: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    sampled_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    train_tokens: Mapped[int] = mapped_column(BigInteger, default=0)


class StepFigureRow(Base):
    """One figure of one training step of a model: the server's own (source "server": loss
    and tokens of its forward_backward calls, grad norm and learning rate of its optim_step)
    or one the user's loop reported (source "user", TrainingClient.log_metrics). One row per
    (model, step, name, source): a later report of the same step replaces the value."""

    __tablename__ = "step_figures"
    __table_args__ = (
        UniqueConstraint("model_id", "step", "name", "source"),
        Index("ix_step_figures_session_step", "session_id", "step"),
    )
    # BIGSERIAL on PostgreSQL; SQLite numbers only an INTEGER PRIMARY KEY by itself
    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    tenant_id: Mapped[str] = mapped_column(String(64), default=DEFAULT_TENANT_ID, index=True)
    session_id: Mapped[str] = mapped_column(String(64))
    model_id: Mapped[str] = mapped_column(String(128))
    step: Mapped[int] = mapped_column(BigInteger)
    name: Mapped[str] = mapped_column(String(128))
    value: Mapped[float] = mapped_column(Float)
    source: Mapped[str] = mapped_column(String(8))  # server | user
    at: Mapped[float] = mapped_column(Float)  # wall-clock seconds


class SpendCapRow(Base):
    """A spend cap: tokens and/or dollars per UTC day or calendar month, for a whole tenant
    (scope "tenant") or one of its keys (scope "key:<key_id>"); treadle.server.tenancy.spend."""

    __tablename__ = "spend_caps"
    __table_args__ = (UniqueConstraint("tenant_id", "scope", "period"),)
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(64), index=True)
    scope: Mapped[str] = mapped_column(String(64))  # tenant | key:<key_id>
    period: Mapped[str] = mapped_column(String(8))  # day | month
    max_tokens: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    max_usd: Mapped[float | None] = mapped_column(Float, nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class AdminKeyRow(Base):
    """An API key that may see every tenant in the console (`treadle admin create-key
    --admin`); the key's own row (ApiKeyRow) still decides whether it is valid."""

    __tablename__ = "admin_keys"
    key_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class CaptureRow(Base):
    """A capture session (treadle.server.core.captures): completions served under it are
    recorded token-exactly. Named by its tenant: (tenant_id, capture_id) is the key, so two
    tenants may use the same name and never see each other's."""

    __tablename__ = "captures"
    tenant_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    capture_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class CapturedCompletionRow(Base):
    """One completion served under a capture session: its rendered prompt, its sampled tokens
    and their logprobs (little-endian int32 / float32 bytes), the weights that sampled it,
    and the provenance sequence_id when the weights were a training session's."""

    __tablename__ = "captured_completions"
    __table_args__ = (Index("ix_captured_completions_capture", "tenant_id", "capture_id"),)
    completion_id: Mapped[str] = mapped_column(String(96), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(64))
    capture_id: Mapped[str] = mapped_column(String(128))
    trajectory_id: Mapped[str] = mapped_column(String(128))
    model: Mapped[str] = mapped_column(String(512))  # the request's `model`
    base_model: Mapped[str] = mapped_column(String(256))
    sampler_version: Mapped[str] = mapped_column(String(512))
    session_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    sequence_id: Mapped[str | None] = mapped_column(String(96), nullable=True)
    prompt: Mapped[bytes] = mapped_column(LargeBinary)
    tokens: Mapped[bytes] = mapped_column(LargeBinary)
    logprobs: Mapped[bytes] = mapped_column(LargeBinary)
    finish_reason: Mapped[str] = mapped_column(String(32))
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class CaptureRewardRow(Base):
    """The reward a tenant attached to one trajectory of a capture session, and the group
    (GRPO's: the rollouts of one problem) its advantage is taken within."""

    __tablename__ = "capture_rewards"
    tenant_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    capture_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    trajectory_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    reward: Mapped[float] = mapped_column(Float)
    group_id: Mapped[str | None] = mapped_column(String(128), nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
