"""What crosses between the API process and an engine worker: typed messages in msgpack.

Ops and outcomes are the dataclasses of treadle.protocol.ops, encoded field by field
with msgspec (no pickle: a worker may connect from another machine). numpy arrays travel
as one msgpack extension each (dtype, shape, raw bytes) and come back as views of the
received buffer: a forward_backward's tokens cross the boundary once, with no per-element
Python conversion. A payload is encoded once, when its request is filed: the same bytes
are the op log entry in the database and the body of the message to the worker.

A message is a ZMQ multipart [kind, body]; on the API's ROUTER socket the worker's
identity frame comes first.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from treadle.engine.types import SampleResult, TrainResult
from treadle.errors import ErrorInfo
from treadle.protocol.facts import EngineFacts
from treadle.protocol.ops import (
    PAYLOAD_OF_KIND,
    LoadResult,
    ModelResult,
    Op,
    OpKind,
    OptimResult,
    Outcome,
    Payload,
    Progress,
    SaveResult,
    SequenceRecord,
    Usage,
)
from treadle.protocol.saved import Saved

PROTOCOL = 4  # 4: Welcome.restores
_ARRAY = 1  # msgpack extension code of a numpy array


class Kind(enum.StrEnum):
    """Message kinds. Worker → API: HELLO, OUTCOMES, PROGRESS, REPLY, REFS, SNAPSHOT,
    HEARTBEAT. API → worker: WELCOME, OP, CALL, HEARTBEAT, REJOIN, SHUTDOWN."""

    HELLO = "hello"  # a worker is up: its model and facts
    WELCOME = "welcome"  # the API took it (anew: "start afresh"; or again, as it is)
    OP = "op"
    OUTCOMES = "outcomes"
    PROGRESS = "progress"  # tokens of streamed sample ops, as they are sampled
    CALL = "call"  # a control call (load a sampler, drop a ref, restore a model, ...)
    REPLY = "reply"  # its answer
    REFS = "refs"  # sampler weights the worker now holds / dropped
    SNAPSHOT = "snapshot"  # a model's state was written to disk up to a seq_id
    FAULT = "fault"  # the engine cannot go on: the worker exits (treadle.protocol.faults)
    HEARTBEAT = "heartbeat"  # from a worker: its WorkerStats
    REJOIN = "rejoin"  # the API does not know this worker (any more): say HELLO again
    SHUTDOWN = "shutdown"  # drain what was acknowledged, snapshot, exit


@dataclass
class Hello:
    worker_id: str
    facts: EngineFacts
    token: str  # the hub's shared secret: only workers the operator started get in
    replica: int = -1  # which replica of its model (-1: any free one, or a new one)
    protocol: int = PROTOCOL
    pid: int = 0
    device: str = "cpu"


@dataclass
class Welcome:
    epoch: str
    # True: the API took this worker anew (it never knew it, or lost it) and restores its
    # models from its records, so a worker that served before drops everything first;
    # False: a repeated HELLO of a worker the API kept, whose models and ops stay as they are
    restores: bool = True


@dataclass
class Call:
    call_id: int
    name: str  # a control call of the worker's engine loop (treadle.worker.loop CONTROLS)
    args: dict[str, Any] = field(default_factory=dict)


@dataclass
class Reply:
    call_id: int
    value: Any = None
    error: ErrorInfo | None = None


@dataclass
class Refs:
    added: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)


@dataclass
class Fault:
    request_ids: list[str]  # the ops that were running
    error: str


@dataclass
class WorkerStats:
    """The body of a worker's heartbeat: what its engine loop is doing now, and counters
    since the worker started (the API turns them into its metrics: a new worker starts them
    from 0 again). An empty heartbeat body (an older worker) says nothing."""

    running: int = 0  # ops in the engine now: the current call's, and the decode batch's
    decode_batch: int = 0  # sample ops in the decode batch
    calls: dict[str, int] = field(default_factory=dict)  # engine calls by kind (train, ...)
    decode_steps: int = 0
    decode_rows: int = 0  # sample ops summed over decode steps (÷ steps: the mean batch)
    # with sampler vllm: requests vLLM took, those given back to Treadle's sampler, parity
    # checks and trips, vLLM process deaths (treadle.worker.vllm.sampler.VllmSampler.counts)
    sampler: dict[str, int] = field(default_factory=dict)


@dataclass
class ProgressMsg:
    items: list[Progress]


@dataclass
class _OpMsg:
    request_id: str
    kind: str
    model_id: str | None
    seq_id: int | None
    replay: bool
    payload: msgspec.Raw
    faults: int = 0
    trace: str | None = None  # W3C traceparent (treadle.protocol.tracing); None: tracing off


_RESULT_TYPES: dict[str, type] = {
    t.__name__: t
    for t in (TrainResult, SampleResult, ModelResult, LoadResult, OptimResult, SaveResult)
}


@dataclass
class _OutcomeMsg:
    request_id: str
    result_type: str | None
    result: msgspec.Raw  # an encoded result, or nil
    error: ErrorInfo | None
    usage: Usage
    records: list[SequenceRecord]
    saved: Saved | None
    started_at: float | None  # wall-clock seconds: comparable across processes
    finished_at: float | None


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        a = np.ascontiguousarray(obj)
        return msgspec.msgpack.Ext(_ARRAY, _meta.encode((a.dtype.str, a.shape, a.data)))
    if isinstance(obj, np.generic):
        return obj.item()
    raise NotImplementedError(f"cannot send a {type(obj).__name__}")


def _ext_hook(code: int, data: memoryview) -> Any:
    if code != _ARRAY:
        raise ValueError(f"unknown msgpack extension {code}")
    dtype, shape, raw = _meta_dec.decode(data)
    return np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape)


def _dec_hook(kind: type, obj: Any) -> Any:
    if kind is np.ndarray and isinstance(obj, np.ndarray):
        return obj
    raise NotImplementedError(f"cannot read a {kind}")


_meta = msgspec.msgpack.Encoder()
_meta_dec = msgspec.msgpack.Decoder(tuple)
_enc = msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def encode(obj: Any) -> bytes:
    return _enc.encode(obj)


def decode(data: bytes | memoryview, kind: type) -> Any:
    return msgspec.msgpack.decode(data, type=kind, ext_hook=_ext_hook, dec_hook=_dec_hook)


# ---- ops ----
def encode_payload(payload: Payload) -> bytes:
    """A payload's bytes: the op log entry and the body of the op message."""
    return encode(payload)


def decode_payload(kind: OpKind, data: bytes | memoryview) -> Payload:
    return decode(data, PAYLOAD_OF_KIND[kind])


def encode_op(op: Op, payload: bytes | None = None) -> bytes:
    raw = msgspec.Raw(payload if payload is not None else encode_payload(op.payload))
    return encode(
        _OpMsg(
            op.request_id, str(op.kind), op.model_id, op.seq_id, op.replay, raw, op.faults, op.trace
        )
    )


def decode_op(data: bytes | memoryview) -> Op:
    m = decode(data, _OpMsg)
    kind = OpKind(m.kind)
    payload = decode_payload(kind, m.payload)
    return Op(
        m.request_id,
        kind,
        payload,
        m.model_id,
        m.seq_id,
        replay=m.replay,
        faults=m.faults,
        trace=m.trace,
    )


@dataclass
class _OutcomesMsg:
    outcomes: list[_OutcomeMsg]


# ---- outcomes ----
def encode_outcomes(outcomes: list[Outcome]) -> bytes:
    msgs = []
    for o in outcomes:
        kind = type(o.result).__name__ if o.result is not None else None
        raw = msgspec.Raw(encode(o.result))
        msgs.append(
            _OutcomeMsg(
                o.request_id,
                kind,
                raw,
                o.error,
                o.usage,
                o.records,
                o.saved,
                o.started_at,
                o.finished_at,
            )
        )
    return encode(_OutcomesMsg(msgs))


def decode_outcomes(data: bytes | memoryview) -> list[Outcome]:
    out = []
    for m in decode(data, _OutcomesMsg).outcomes:
        result = None
        if m.result_type is not None:
            result = decode(m.result, _RESULT_TYPES[m.result_type])
        out.append(
            Outcome(
                m.request_id,
                result=result,
                error=m.error,
                usage=m.usage,
                records=m.records,
                saved=m.saved,
                started_at=m.started_at,
                finished_at=m.finished_at,
            )
        )
    return out
