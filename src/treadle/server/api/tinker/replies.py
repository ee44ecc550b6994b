"""The body a retrieve_future poll gets: try_again, a failed future's error, or a result,
as protobuf when the client asks for it (the tinker SDK does for forward_backward and
sample), else as JSON; metered results carry their usage
(treadle.server.tenancy.metering)."""

from __future__ import annotations

import json

from treadle.protocol.ops import METERED_KINDS, OpKind, sample_sequence_id
from treadle.server.core.futures import Polled
from treadle.server.core.results import JSON_TYPE, PROTO_TYPE
from treadle.server.tenancy.metering import with_usage
from treadle.wire import codec

__all__ = ["reply", "sample_sequence_id"]


def reply(
    request_id: str,
    polled: Polled,
    want_proto: bool,
    queue: tuple[str, str | None] = ("active", None),
) -> tuple[bytes, str]:
    """→ (body, content type) of a poll; `queue`: a pending future's queue state and its
    reason (treadle.server.core.queue_state)."""
    done = polled.finished
    if done is None:
        body = {"type": "try_again", "request_id": request_id, "queue_state": queue[0]}
        if queue[1] is not None:
            body["queue_state_reason"] = queue[1]
        return json.dumps(body).encode(), JSON_TYPE
    if done.status == "failed":
        return json.dumps(done.error).encode(), JSON_TYPE
    result, content_type = done.result, done.content_type
    if content_type == PROTO_TYPE and not want_proto:
        result, content_type = _proto_as_json(request_id, polled.kind, result), JSON_TYPE
    if polled.kind not in METERED_KINDS:
        return result, content_type
    usage = {
        "prefill_tokens": done.prompt_tokens,
        "sample_tokens": done.sampled_tokens,
        "train_tokens": done.train_tokens,
        "cached_prefill_tokens": done.cached_prompt_tokens,
    }
    return with_usage(result, content_type, usage), content_type


def _proto_as_json(request_id: str, kind: str, result: bytes) -> bytes:
    if kind == OpKind.SAMPLE:
        resp = codec.decode_sample_response(result)
        for i, seq in enumerate(resp.sequences):
            seq.sequence_id = sample_sequence_id(request_id, i)
        return resp.model_dump_json().encode()
    return codec.decode_forward_backward_output(result).model_dump_json().encode()
