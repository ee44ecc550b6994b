"""What a save wrote besides its files: the rows the API commits in the transaction of the
save's result (the engine worker writes no database rows; treadle.worker.checkpoints makes
these, treadle.server.core.saves commits them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class CheckpointRecord:
    """A checkpoint folder a save wrote: its row, committed with the save's result."""

    tinker_path: str
    run_id: str
    model_id: str
    checkpoint_type: str  # training | sampler | external
    name: str
    dir: str
    base_model: str
    lora_config: dict[str, Any]
    size_bytes: int
    tenant_id: str
    user_metadata: dict[str, Any] | None = None
    expires_in_s: int | None = None  # its TTL (the API stamps expires_at as it commits)


@dataclass
class SamplerRecord:
    """A sampling session a snapshot op made (its weights in the worker's memory)."""

    sampling_session_id: str
    session_id: str | None
    seq_id: int | None
    base_model: str
    model_id: str
    engine_ref: str
    tenant_id: str


@dataclass
class VersionRecord:
    """A model package version whose files a save stored (a folder or S3 objects, complete):
    the API numbers it and registers it with the save's result."""

    tenant_id: str
    group_name: str
    kind: str  # sampler | merged | state
    location: str
    size_bytes: int
    encrypted: bool
    key_id: str | None
    base_model: str
    lora_config: dict[str, Any]
    name: str | None = None
    session_id: str | None = None
    model_id: str | None = None
    run_id: str | None = None
    step: int | None = None
    user_metadata: dict[str, Any] | None = None
    tinker_path: str | None = None
    source: str | None = None


@dataclass
class Saved:
    """What a save wrote besides files, for the API to commit in the transaction of its
    result (the worker writes no database rows)."""

    checkpoints: list[CheckpointRecord] = field(default_factory=list)
    samplers: list[SamplerRecord] = field(default_factory=list)
    versions: list[VersionRecord] = field(default_factory=list)
