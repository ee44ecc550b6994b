"""JSON bodies of the Tinker REST endpoints (SDK 0.38), requests and replies, field for field.

Both the server (to parse) and the treadle SDK (to build) use these. Unknown fields are
ignored, so newer clients still talk to us; `type` literals are kept because the SDK's reply
models check them. Tensors, datums and results themselves live in treadle.types.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from treadle.types import (
    AdamParams,
    Checkpoint,
    LoraConfig,
    ModelInput,
    SamplingParams,
    SupportedModel,
    TrainingRun,
)

# ---- bounded fields -------------------------------------------------------------------------
# Every integer a request carries is stored or compared as an int64 somewhere (SQLite, numpy,
# torch): one outside that range is a 400 naming its field, never an overflow deeper in.
INT64_MAX = 2**63 - 1
Int64 = Annotated[int, Field(ge=-(2**63), le=INT64_MAX)]
SeqId = Annotated[int, Field(ge=0, le=INT64_MAX)]
"""seq_id, model_seq_id, sampling_session_seq_id: a non-negative int64."""

MAX_METADATA_ENTRIES = 64
MAX_METADATA_KEY_CHARS = 256
MAX_METADATA_VALUE_CHARS = 4096


def _check_metadata(value: dict[str, str]) -> dict[str, str]:
    if len(value) > MAX_METADATA_ENTRIES:
        raise ValueError(f"at most {MAX_METADATA_ENTRIES} entries, got {len(value)}")
    for key, text in value.items():
        if not 1 <= len(key) <= MAX_METADATA_KEY_CHARS:
            raise ValueError(
                f"keys hold 1 to {MAX_METADATA_KEY_CHARS} characters, got one of {len(key)}"
            )
        if len(text) > MAX_METADATA_VALUE_CHARS:
            raise ValueError(
                f"value of {key[:40]!r}: at most {MAX_METADATA_VALUE_CHARS} characters, "
                f"got {len(text)}"
            )
    return value


UserMetadata = Annotated[dict[str, str], AfterValidator(_check_metadata)]
"""user_metadata of a session, model or checkpoint: string keys to string values (what every
reply model returns), at most 64 entries of 256-character keys and 4096-character values."""
ShortText = Annotated[str, Field(max_length=256)]
Tags = Annotated[list[ShortText], Field(max_length=64)]


class _Body(BaseModel):
    # protected_namespaces=(): fields called model_id / model_seq_id are the protocol's.
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


# ---- client bootstrap and sessions --------------------------------------------------------


class ClientConfigRequest(_Body):
    """POST client/config and client/dynamic_config."""

    sdk_version: str | None = None


class ClientConfigResponse(_Body):
    """Feature flags; we leave every optional protocol off and the transport on httpx."""

    pjwt_auth_enabled: bool = False
    use_pyqwest_transport: bool = False
    proto_compress_fwdbwd: bool = False
    parallel_fwdbwd_chunks: bool = True
    sample_use_retrieve_futures: bool = False
    custom_loss_server_side: bool = False
    sample_join_sampling_session: bool = False


class ClientDynamicConfigResponse(_Body):
    refresh_interval_sec: int = 300
    sample_cancel_enabled: bool = False
    sample_cancel_max_batch_size: int = 64


class CreateSessionRequest(_Body):
    tags: Tags = Field(default_factory=list)
    user_metadata: UserMetadata | None = None
    sdk_version: ShortText | None = None
    project_id: ShortText | None = None
    display_name: ShortText | None = None
    type: Literal["create_session"] = "create_session"


class CreateSessionResponse(_Body):
    session_id: str
    info_message: str | None = None
    warning_message: str | None = None
    error_message: str | None = None
    type: Literal["create_session"] = "create_session"


class SessionHeartbeatRequest(_Body):
    session_id: str
    type: Literal["session_heartbeat"] = "session_heartbeat"


class SessionHeartbeatResponse(_Body):
    type: Literal["session_heartbeat"] = "session_heartbeat"


class FinishReason(_Body):
    type: str = "success"  # success | errored | interrupted


class SessionFinishRequest(_Body):
    """POST sessions/{session_id}/finish."""

    reason: FinishReason | None = None
    detail: str | None = None


class TelemetryResponse(_Body):
    status: Literal["accepted"] = "accepted"


class HealthResponse(_Body):
    status: Literal["ok"] = "ok"


class GetServerCapabilitiesResponse(_Body):
    supported_models: list[SupportedModel]


# ---- futures --------------------------------------------------------------------------------


class UntypedAPIFuture(_Body):
    """The reply of every submit."""

    request_id: str
    model_id: str | None = None
    sample_sequence_ids: list[str] | None = None


class FutureRetrieveRequest(_Body):
    request_id: str
    allow_metadata_only: bool = False


class TryAgainResponse(_Body):
    type: Literal["try_again"] = "try_again"
    request_id: str
    queue_state: Literal["active", "paused_capacity", "paused_rate_limit"] = "active"
    queue_state_reason: str | None = None


class RequestFailedResponse(_Body):
    error: str
    category: Literal["unknown", "server", "user"] = "unknown"


# ---- training models ------------------------------------------------------------------------


class OptimizerConfig(_Body):
    """{"type": "adamw"} or {"type": "dimuon", "version": 1}; we run adamw only."""

    model_config = ConfigDict(extra="allow")
    type: str = "adamw"


class CreateModelRequest(_Body):
    session_id: str
    model_seq_id: SeqId
    base_model: str
    user_metadata: UserMetadata | None = None
    lora_config: LoraConfig | None = None
    optimizer_config: OptimizerConfig = Field(default_factory=OptimizerConfig)
    # treadle: saves of this model become versions of this model package group
    model_package_group: str | None = None
    output_path: str | None = None  # s3://bucket/prefix or a server folder
    type: Literal["create_model"] = "create_model"


class CreateModelResponse(_Body):
    model_id: str
    type: Literal["create_model"] = "create_model"


class GetInfoRequest(_Body):
    model_id: str
    type: Literal["get_info"] = "get_info"


class UnloadModelRequest(_Body):
    model_id: str
    type: Literal["unload_model"] = "unload_model"


class UnloadModelResponse(_Body):
    model_id: str
    type: Literal["unload_model"] = "unload_model"


class OptimStepRequest(_Body):
    """The SDK sends `adam_params`, or `optimizer_params` for other optimizers."""

    model_id: str
    seq_id: SeqId | None = None
    adam_params: AdamParams | None = None
    optimizer_params: dict[str, Any] | None = None
    type: Literal["optim_step"] = "optim_step"


# ---- checkpoints ----------------------------------------------------------------------------


class SaveWeightsRequest(_Body):
    """save_state: `path` is a checkpoint name → tinker://<run>/weights/<name>."""

    model_id: str
    path: str | None = None
    seq_id: SeqId | None = None
    ttl_seconds: Int64 | None = None
    overwrite: bool = False
    user_metadata: UserMetadata | None = None
    type: Literal["save_weights"] = "save_weights"


class SaveWeightsForSamplerRequest(_Body):
    """With `path` (a name): a durable PEFT adapter. Without it (and with
    `sampling_session_seq_id`): an in-memory snapshot to sample from at once."""

    model_id: str
    path: str | None = None
    sampling_session_seq_id: SeqId | None = None
    kind: Literal["snapshot", "inflight"] = "snapshot"
    seq_id: SeqId | None = None
    ttl_seconds: Int64 | None = None
    user_metadata: UserMetadata | None = None
    merge_weights: bool = False  # treadle: also publish a merged HF model version
    type: Literal["save_weights_for_sampler"] = "save_weights_for_sampler"


class LoadWeightsRequest(_Body):
    """Legacy form: model_id + seq_id, into an existing model. Create-via-load form:
    session_id + model_seq_id, creating model "<session_id>:train:<model_seq_id>"."""

    model_id: str | None = None
    seq_id: SeqId | None = None
    session_id: str | None = None
    model_seq_id: SeqId | None = None
    base_model: str | None = None
    user_metadata: UserMetadata | None = None
    path: str
    optimizer: bool = False
    optimizer_config: OptimizerConfig | None = None
    weights_access_token: str | None = None
    # treadle, create-via-load: bind the new model to a model package group
    model_package_group: str | None = None
    output_path: str | None = None
    type: Literal["load_weights"] = "load_weights"


class SaveWeightsResponse(_Body):
    path: str
    type: Literal["save_weights"] = "save_weights"


class SaveWeightsForSamplerResponse(_Body):
    path: str | None = None
    sampling_session_id: str | None = None
    type: Literal["save_weights_for_sampler"] = "save_weights_for_sampler"


class LoadWeightsResponse(_Body):
    path: str | None = None
    model_id: str | None = None
    type: Literal["load_weights"] = "load_weights"


class WeightsInfoRequest(_Body):
    tinker_path: str


class WeightsInfoResponse(_Body):
    base_model: str
    optimizer_config: OptimizerConfig = Field(default_factory=OptimizerConfig)
    is_lora: bool = True
    lora_rank: int | None = None
    train_unembed: bool | None = None
    train_mlp: bool | None = None
    train_attn: bool | None = None


class Cursor(_Body):
    offset: int
    limit: int
    total_count: int


class CheckpointsListResponse(_Body):
    checkpoints: list[Checkpoint]
    cursor: Cursor | None = None


class TrainingRunsResponse(_Body):
    training_runs: list[TrainingRun]
    cursor: Cursor


class ListSessionsResponse(_Body):
    sessions: list[str]


class GetSessionResponse(_Body):
    training_run_ids: list[str]
    sampler_ids: list[str]
    user_metadata: dict[str, str] | None = None
    display_name: str | None = None


# ---- sampling -------------------------------------------------------------------------------


class CreateSamplingSessionRequest(_Body):
    session_id: str
    sampling_session_seq_id: SeqId
    base_model: str | None = None
    model_path: str | None = None
    type: Literal["create_sampling_session"] = "create_sampling_session"


class CreateSamplingSessionResponse(_Body):
    sampling_session_id: str
    type: Literal["create_sampling_session"] = "create_sampling_session"


class GetSamplerResponse(_Body):
    sampler_id: str
    base_model: str
    model_path: str | None = None


class SampleRequest(_Body):
    """POST asample. The reply must carry one `sample_sequence_ids` entry per sample."""

    num_samples: Int64 = 1
    prompt: ModelInput
    sampling_params: SamplingParams
    base_model: str | None = None
    model_path: str | None = None
    sampling_session_id: str | None = None
    seq_id: SeqId | None = None
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: Int64 = 0
    topk_sample_logprobs: Int64 = 0
    # the SDK's TensorData JSON, dense or sparse CSR: validation.target_prompt_ids reads it
    target_prompt_logprobs: dict[str, Any] | None = None
    prompt_alt_tokens_k: Int64 = 0
    prompt_logprobs_last_n: Int64 | None = None
    record_stability_info: bool | None = None
    type: Literal["sample"] = "sample"
