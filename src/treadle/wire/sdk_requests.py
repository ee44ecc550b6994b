"""JSON bodies of the rest of the Tinker SDK's routes (0.38, and the checkpoint search and
external-weights upload of its newer versions), field for field as the SDK sends and reads
them: custom losses, cancellation and batch polling of futures, joining a sampling session,
copies, publication, TTL, session and checkpoint search, and the account routes.

The server parses these and the treadle SDK builds them (treadle.wire.requests has the
core protocol's bodies).
"""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Any, Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field

from treadle.types import Checkpoint
from treadle.wire.requests import SeqId, ShortText, UserMetadata


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


TTL_MAX_S = 10 * 366 * 86400  # ten years, the SDK's own upper bound
TtlSeconds = Annotated[int, Field(ge=1, le=TTL_MAX_S)]


# ---- custom losses ---------------------------------------------------------------------------
class CreateCustomLossRequest(_Body):
    session_id: str
    custom_loss_seq_id: SeqId
    name: ShortText
    inputs: list[dict[str, Any]] = Field(max_length=64)
    graph: dict[str, Any]
    type: Literal["create_custom_loss"] = "create_custom_loss"


# ---- futures ---------------------------------------------------------------------------------
class CancelFutureRequest(_Body):
    request_id: ShortText


class SamplingSessionFuturesTarget(_Body):
    type: Literal["sampling_session"] = "sampling_session"
    sampling_session_id: ShortText
    cloned_sampler_id: Annotated[int, Field(ge=0, le=2**62)] = 0


class FuturesRetrieveRequest(_Body):
    target: SamplingSessionFuturesTarget
    prev_cursor: Annotated[int, Field(ge=0, le=2**62)] = 0
    timeout: Annotated[float, Field(ge=0, le=3600)] | None = None
    retrieved_request_ids: list[ShortText] = Field(default_factory=list, max_length=100_000)


class JoinSamplingSessionRequest(_Body):
    sampling_session_id: ShortText
    type: Literal["join_sampling_session"] = "join_sampling_session"


# ---- checkpoints -----------------------------------------------------------------------------
class CopyWeightsRequest(_Body):
    session_id: ShortText | None = None
    model_seq_id: SeqId | None = None
    destination_project_id: ShortText | None = None
    source_path: Annotated[str, Field(max_length=1024)]
    ttl_seconds: TtlSeconds | None = None
    weights_access_token: ShortText | None = None


class CheckpointTtlRequest(_Body):
    ttl_seconds: TtlSeconds | None = None
    """Seconds from now until the checkpoint's files are deleted; null: it never expires."""


class CheckpointSearchCursor(_Body):
    """Where the next page starts: the last checkpoint of the previous one."""

    last_time: AwareDatetime
    last_tinker_path: str


class CheckpointSearchRequest(_Body):
    """A search of checkpoints, newest first. Every filter given must hold."""

    project_id: ShortText | None = None
    """Checkpoints of sessions in this project."""
    user_metadata: UserMetadata = Field(default_factory=dict)
    """Exact key/value matches on the checkpoint's user_metadata; every pair must hold."""
    checkpoint_type: Literal["training", "sampler", "external"] | None = None
    owner: Literal["own", "accessible"] = "own"
    """own: the caller's checkpoints; accessible: also those other tenants published."""
    base_model: ShortText | None = None
    training_run_id: ShortText | None = None
    limit: Annotated[int, Field(ge=1, le=200)] = 50
    cursor: CheckpointSearchCursor | None = None


class CheckpointSearchResponse(_Body):
    checkpoints: list[Checkpoint]
    next_cursor: CheckpointSearchCursor | None = None
    """Pass as the next request's `cursor`; None once the results are exhausted."""


class ExternalWeightsUploadStartRequest(_Body):
    """Start an upload of a PEFT adapter's files into a new checkpoint."""

    base_model: ShortText
    name: ShortText
    """The checkpoint's name: tinker://<run>/external_weights/<name> once finished."""
    files: dict[ShortText, Annotated[int, Field(ge=0)]] = Field(min_length=1, max_length=64)
    """Each file's name (adapter_config.json, adapter_model.safetensors, ...) and size."""
    ttl_seconds: TtlSeconds | None = None
    user_metadata: UserMetadata | None = None


class ExternalWeightsUploadStartResponse(_Body):
    upload_id: str
    urls: dict[str, str]
    """One signed URL per file: PUT the file's bytes there, once, before `expires`."""
    expires: dt.datetime


class ExternalWeightsUploadFinishRequest(_Body):
    upload_id: ShortText


class ExternalWeightsUploadFinishResponse(_Body):
    tinker_path: str
    size_bytes: int


# ---- sessions ------------------------------------------------------------------------------
class SessionProjectRequest(_Body):
    project_id: ShortText


class SessionSearchCursor(_Body):
    last_created_at: AwareDatetime
    last_session_id: str


class SessionSearchRequest(_Body):
    session_id: ShortText | None = None
    project_ids: list[ShortText] | None = Field(default=None, max_length=100)
    user_metadata: UserMetadata = Field(default_factory=dict)
    display_name: ShortText | None = Field(default=None, min_length=1)
    owner: dict[str, Any] = Field(default_factory=lambda: {"type": "own"})
    statuses: list[dict[str, Any]] | None = Field(default=None, min_length=1, max_length=8)
    limit: Annotated[int, Field(ge=1, le=200)] = 50
    cursor: SessionSearchCursor | None = None


# ---- account -------------------------------------------------------------------------------
class BillingUsageQuery(_Body):
    starting_on: AwareDatetime
    ending_before: AwareDatetime
