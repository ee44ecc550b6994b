"""Outcomes in the wire's form: the body a `retrieve_future` returns and the database keeps.

Typed results become bytes here, once per result, on the journal thread (never on the
engine thread or the event loop): ForwardBackwardOutput and SampleResponse as protobuf
(what the Tinker SDK requires), everything else as JSON. In-process callers (the OpenAI
routes) use the typed result and never see these bytes; a result this process no longer
holds is read back from its row as a Finished.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from treadle.engine.types import SampleResult, TrainResult
from treadle.errors import ErrorInfo
from treadle.protocol.ops import Outcome
from treadle.server.storage.queries import Finished
from treadle.types import SampledSequence, SampleResponse, TensorData
from treadle.wire import codec

JSON_TYPE = "application/json"
PROTO_TYPE = "application/x-protobuf"


def encode(outcome: Outcome) -> Finished:
    """The row columns of a finished outcome; sets outcome.body / content_type too."""
    u = outcome.usage
    if outcome.error is not None:  # usage: what ran of it (a cancelled generation)
        return Finished(
            outcome.request_id,
            "failed",
            error=error_json(outcome.error),
            prompt_tokens=u.prompt_tokens,
            sampled_tokens=u.sampled_tokens,
            train_tokens=u.train_tokens,
            cached_prompt_tokens=u.cached_prompt_tokens,
        )
    if outcome.body is None:
        outcome.body, outcome.content_type = _body(outcome.result)
    return Finished(
        outcome.request_id,
        "done",
        result=outcome.body,
        content_type=outcome.content_type,
        prompt_tokens=u.prompt_tokens,
        sampled_tokens=u.sampled_tokens,
        train_tokens=u.train_tokens,
        cached_prompt_tokens=u.cached_prompt_tokens,
    )


def error_json(error: ErrorInfo) -> dict[str, str]:
    """A failed future's body: what the SDKs read ("error", "category"), and the error's
    class, so that an in-process caller raises the same class from a stored row."""
    return {**error.to_json(), "error_type": error.type}


def error_of(stored: dict[str, Any]) -> ErrorInfo:
    return ErrorInfo(
        stored.get("error_type", "TreadleError"),
        str(stored.get("error")),
        stored.get("category", "server"),
    )


def _body(result: Any) -> tuple[bytes, str]:
    if isinstance(result, TrainResult):
        body = codec.encode_forward_backward_arrays(
            result.outputs, {k: float(v) for k, v in result.metrics.items()}
        )
        return body, PROTO_TYPE
    if isinstance(result, SampleResult):
        return codec.encode_sample_response(sample_response(result)), PROTO_TYPE
    return json.dumps(result.to_json()).encode(), JSON_TYPE


def sample_response(result: SampleResult) -> SampleResponse:
    alt = result.prompt_alt_tokens
    target = result.target_prompt_logprobs
    return SampleResponse(
        sequences=[
            SampledSequence(
                stop_reason=s.stop_reason,
                tokens=s.tokens,
                logprobs=s.logprobs,
                topk_logprobs=s.topk,
                sampling_logprobs=s.sampling_logprobs,
            )
            for s in result.sequences
        ],
        prompt_logprobs=result.prompt_logprobs,
        topk_prompt_logprobs=result.topk_prompt_logprobs,
        target_prompt_logprobs=None if target is None else TensorData.from_numpy(target),
        prompt_cache_hit_tokens=result.prompt_cache_hit_tokens,
        prompt_alt_tokens=None
        if alt is None
        else (TensorData.from_numpy(np.asarray(alt[0])), TensorData.from_numpy(alt[1])),
    )


def finished_of_row(row: dict[str, Any]) -> Finished:
    """A request row's columns → its Finished (a result this process no longer holds)."""
    if row["status"] == "failed":
        return Finished(row["request_id"], "failed", error=error_json(error_of(row["error"])))
    return Finished(
        row["request_id"],
        "done",
        result=row["result"],
        content_type=row["content_type"],
        prompt_tokens=row["prompt_tokens"] or 0,
        sampled_tokens=row["sampled_tokens"] or 0,
        train_tokens=row["train_tokens"] or 0,
        cached_prompt_tokens=row.get("cached_prompt_tokens") or 0,
    )
