"""The typed op pipeline: what the API hands an engine (an Op) and what comes back (an Outcome).

Ops and outcomes are plain data (dataclasses of numbers, strings, numpy arrays and the
engine's own dataclasses), so that they can cross a thread or a process boundary as they
are. The wire formats (protobuf, JSON bodies) are made at the edges, never here.

One op kind, one payload class:

| kind             | payload        | ordered in its model's seq_id queue |
|------------------|----------------|--------------------------------------|
| create           | CreateAdapter  | yes (seq 0)                          |
| load             | LoadWeights    | yes                                  |
| forward(_backward)| TrainData     | yes; consecutive ones share a call   |
| optim_step       | OptimStep      | yes (a barrier for its model)        |
| save_state       | SaveState      | yes                                  |
| save_sampler     | SaveSampler    | yes (written to disk at idle times)  |
| snapshot         | Snapshot       | yes (a sampler served from memory)   |
| skip             | Skip           | yes: a request refused at the edge holds its seq_id's place |
| sample           | Sample         | no (decoded a few tokens per round)  |
| unload           | Unload         | no (a control call)                  |
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from treadle.engine.types import (
    AdamSpec,
    LoraSpec,
    SampleRequest,
    SampleResult,
    TrainDatum,
    TrainResult,
)
from treadle.errors import ErrorInfo
from treadle.protocol.saved import Saved


class OpKind(enum.StrEnum):
    CREATE = "create"
    LOAD = "load"
    FORWARD = "forward"
    FORWARD_BACKWARD = "forward_backward"
    OPTIM_STEP = "optim_step"
    SAVE_STATE = "save_state"
    SAVE_SAMPLER = "save_sampler"
    SNAPSHOT = "snapshot"
    SKIP = "skip"
    SAMPLE = "sample"
    UNLOAD = "unload"


TRAIN_KINDS = frozenset({OpKind.FORWARD, OpKind.FORWARD_BACKWARD})
# The kinds that change a model's state (adapter, optimizer, step, accumulated gradients):
# what recovery replays after the last snapshot. Saves, forwards and skips change nothing.
STATE_KINDS = frozenset({OpKind.CREATE, OpKind.LOAD, OpKind.FORWARD_BACKWARD, OpKind.OPTIM_STEP})
# The kinds whose results carry token usage (treadle.server.tenancy.metering).
METERED_KINDS = frozenset({*TRAIN_KINDS, OpKind.SAMPLE})


# ---- payloads ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class PackageTarget:
    """Where a save of a model bound to a model package group publishes its versions."""

    tenant_id: str
    group: str
    output_root: str  # a server folder or s3://bucket/prefix
    base_model: str
    lora_config: dict[str, Any]
    key: bytes | None = None  # the tenant's encryption key (never stored)
    session_id: str | None = None
    model_id: str | None = None
    run_id: str | None = None


@dataclass(frozen=True)
class CheckpointInfo:
    """What a save records about its checkpoint besides the weights."""

    name: str
    run_id: str
    base_model: str
    lora_config: dict[str, Any]
    tenant_id: str
    user_metadata: dict[str, Any] | None = None
    ttl_s: int | None = None  # its files are deleted this long after the save


@dataclass
class CreateAdapter:
    lora: LoraSpec


@dataclass
class LoadWeights:
    dir: str
    checkpoint_type: str  # training (adapter + optimizer) | sampler (adapter)
    optimizer: bool
    path: str  # what the client asked for (a tinker:// path or GROUP:N)
    cleanup: bool = False  # dir is a temporary copy (decrypted or downloaded): delete it after


@dataclass
class CustomLossRef:
    """A loss uploaded with create_custom_loss, as a train op carries it: the upload itself
    (its name, inputs and graph, JSON), so that the op log replays exactly what ran."""

    loss_id: str
    upload: str


@dataclass
class TrainData:
    data: list[TrainDatum]
    loss_fn: str
    loss_config: dict[str, float]
    custom: CustomLossRef | None = None  # loss_fn "custom" (treadle.engine.loss_graph)

    @property
    def n_tokens(self) -> int:
        return sum(len(d.tokens) for d in self.data)


@dataclass
class OptimStep:
    adam: AdamSpec


@dataclass
class SaveState:
    ckpt: CheckpointInfo
    overwrite: bool = False
    package: PackageTarget | None = None


@dataclass
class SaveSampler:
    ckpt: CheckpointInfo
    package: PackageTarget | None = None
    merge_weights: bool = False
    checkpoint_type: str = "sampler"  # or "external" (save_weights_external)
    age_recipients: list[str] | None = None


@dataclass
class Snapshot:
    sampling_session_id: str
    sampling_session_seq_id: int
    session_id: str
    base_model: str
    tenant_id: str
    package: PackageTarget | None = None


@dataclass
class Skip:
    error: ErrorInfo


@dataclass(frozen=True)
class RecordTo:
    """Whose sampled sequences a sample request records (record_stability_info)."""

    tenant_id: str
    session_id: str


@dataclass
class Sample:
    request: SampleRequest
    prompt_logprobs_last_n: int | None = None
    record: RecordTo | None = None  # keep its sequences for provenance (core.sequences)
    stream: bool = False  # report its tokens as they are sampled (Progress), for an SSE stream


@dataclass
class Unload:
    reason: str


Payload = (
    CreateAdapter
    | LoadWeights
    | TrainData
    | OptimStep
    | SaveState
    | SaveSampler
    | Snapshot
    | Skip
    | Sample
    | Unload
)

PAYLOAD_OF_KIND: dict[OpKind, type] = {
    OpKind.CREATE: CreateAdapter,
    OpKind.LOAD: LoadWeights,
    OpKind.FORWARD: TrainData,
    OpKind.FORWARD_BACKWARD: TrainData,
    OpKind.OPTIM_STEP: OptimStep,
    OpKind.SAVE_STATE: SaveState,
    OpKind.SAVE_SAMPLER: SaveSampler,
    OpKind.SNAPSHOT: Snapshot,
    OpKind.SKIP: Skip,
    OpKind.SAMPLE: Sample,
    OpKind.UNLOAD: Unload,
}


@dataclass
class Op:
    """One queued request: what the engine must do for one future."""

    request_id: str
    kind: OpKind
    payload: Payload
    model_id: str | None = None
    seq_id: int | None = None
    # Re-run during recovery to rebuild a model's state: its outcome was already recorded
    # (or is being recorded), so nobody hears of it again.
    replay: bool = False
    # Engine faults this op was running at (treadle.protocol.faults): from 1 on it
    # runs alone, so that the next fault, if any, names the op that caused it.
    faults: int = 0
    enqueued_at: float = field(default_factory=time.monotonic)
    # The W3C traceparent of the request that filed it, when tracing is on (None when off):
    # the worker's span of the engine call it runs in is a child of it (treadle.protocol.tracing)
    trace: str | None = None
    # The payload as the op log stores it and as a worker receives it (encoded once)
    encoded: bytes | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        expected = PAYLOAD_OF_KIND[self.kind]
        if not isinstance(self.payload, expected):
            raise TypeError(
                f"op {self.kind}: payload must be {expected.__name__}, "
                f"got {type(self.payload).__name__}"
            )


# ---- results ----------------------------------------------------------------------------------


@dataclass
class ModelResult:
    """create_model and unload_model."""

    model_id: str
    type: str  # "create_model" | "unload_model"

    def to_json(self) -> dict[str, Any]:
        return {"model_id": self.model_id, "type": self.type}


@dataclass
class LoadResult:
    path: str
    model_id: str

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "model_id": self.model_id, "type": "load_weights"}


@dataclass
class OptimResult:
    metrics: dict[str, float]

    def to_json(self) -> dict[str, Any]:
        return {"metrics": self.metrics}


@dataclass
class SaveResult:
    """save_state, save_weights_for_sampler (named, or a snapshot), save_weights_external."""

    path: str | None
    type: str  # save_weights | save_weights_for_sampler | save_weights_external
    versions: list[str] | None = None  # GROUP:N of each version it registered
    sampling_session_id: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"path": self.path, "type": self.type}
        if self.sampling_session_id is not None:
            out["sampling_session_id"] = self.sampling_session_id
        if self.versions is not None:
            out["versions"] = self.versions
        return out


# TrainResult (forward, forward_backward) and SampleResult (sample) are the engine's own.
Result = TrainResult | SampleResult | ModelResult | LoadResult | OptimResult | SaveResult


@dataclass
class Usage:
    """Metered tokens of one op (treadle.server.tenancy.metering)."""

    prompt_tokens: int = 0  # prefilled: a sample's prompt less what the prefix cache held
    sampled_tokens: int = 0
    train_tokens: int = 0
    cached_prompt_tokens: int = 0  # a sample's prompt tokens the prefix cache held


def sample_sequence_id(request_id: str, index: int) -> str:
    """The id of a sample request's index-th sequence (its submit reply lists them)."""
    return f"{request_id}:{index}"


@dataclass
class SequenceRecord:
    """One sampled sequence to keep with its request's result (treadle.server.core.sequences)."""

    sequence_id: str
    tenant_id: str
    session_id: str
    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]


@dataclass
class Progress:
    """Tokens a streamed sample op sampled since its last Progress (not an outcome: nothing
    is recorded), each as (sample index, position, token id, logprob). An op run again (its
    worker restarted) reports from position 0 again, with the same tokens when it has a seed.
    """

    request_id: str
    tokens: list[tuple[int, int, int, float]]


@dataclass
class Outcome:
    """What became of one op: its typed result, or the error it failed with.

    `body` / `content_type` hold the wire form once made (treadle.server.core.results), so a
    result is encoded once, off the event loop, for both the database and the poll.
    `records`: sampled sequences committed with the result (record_stability_info);
    `saved`: the rows a save's files need (checkpoint, sampler, versions), committed with it.
    `started_at` / `finished_at` are wall-clock seconds (time.time(), comparable across
    processes) of the engine call that produced it, stamped by the engine loop; None for an
    op that never reached the engine (refused, or its model gone).
    """

    request_id: str
    result: Result | None = None
    error: ErrorInfo | None = None
    usage: Usage = field(default_factory=Usage)
    body: bytes | None = None
    content_type: str | None = None
    records: list[SequenceRecord] = field(default_factory=list)
    saved: Saved | None = None
    started_at: float | None = None
    finished_at: float | None = None

    @classmethod
    def ok(cls, request_id: str, result: Result, usage: Usage | None = None) -> Outcome:
        return cls(request_id, result=result, usage=usage or Usage())

    @classmethod
    def failed(cls, request_id: str, error: BaseException | ErrorInfo) -> Outcome:
        info = error if isinstance(error, ErrorInfo) else ErrorInfo.of(error)
        return cls(request_id, error=info)

    @property
    def succeeded(self) -> bool:
        return self.error is None

    def timed(self, started_at: float) -> Outcome:
        """This outcome, stamped as produced by an engine call that began at started_at
        and ends now."""
        if self.started_at is None:
            self.started_at = started_at
        self.finished_at = time.time()
        return self
