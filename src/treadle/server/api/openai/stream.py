"""Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`: the framing, and
the replay of a whole result.

Most streams go out token by token as they are sampled (treadle.server.api.openai.live).
Answers whose chunks need the whole answer (top_logprobs, tool calls, legacy completion
logprobs) are sampled whole, then replayed here one token at a time: a role chunk, one
content delta per token with its logprobs, a finish chunk per choice, then the usage chunk
when stream_options.include_usage asks for it. Their errors therefore come as ordinary JSON
error responses, never in the middle of a stream.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from fastapi.responses import StreamingResponse

from treadle.server.api.openai.completions import Prepared, Result
from treadle.server.api.openai.render import chat_logprobs, legacy_logprobs

HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = "[DONE]"


def sse(obj: dict[str, Any] | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


def streaming_response(chunks: Iterator[dict[str, Any]]) -> StreamingResponse:
    # Made here, on the event loop: the response iterates its body on a worker thread,
    # where the shared tokenizer must not be used.
    events = [sse(chunk) for chunk in chunks] + [sse(DONE)]
    return StreamingResponse(iter(events), media_type="text/event-stream", headers=HEADERS)


def frame(r: Result | Prepared, obj: str) -> dict[str, Any]:
    """What every chunk of a response carries (r: the result, or the prepared request)."""
    out = {"id": r.id, "object": obj, "created": r.created, "model": r.model}
    out["system_fingerprint"] = None  # the field OpenAI's chunks always carry
    if r.spec.include_usage:
        out["usage"] = None
    return out


def usage_chunk(r: Result, obj: str) -> dict[str, Any]:
    return {**frame(r, obj), "choices": [], "usage": r.usage}


def chat_chunks(r: Result) -> Iterator[dict[str, Any]]:
    obj = "chat.completion.chunk"

    def chunk(index: int, delta: dict, logprobs: Any = None, finish: str | None = None) -> dict:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {**frame(r, obj), "choices": [choice]}

    for c in r.choices:
        s = c.sampled
        entries = chat_logprobs(r.token_text, s.tokens_T, s.logprobs_T, s.top_TK)
        yield chunk(c.index, {"role": "assistant", "content": ""})
        if c.parsed.tool_calls:
            # a call is only known once its closing tag is out: content, then the calls whole
            if c.parsed.content:
                yield chunk(c.index, {"content": c.parsed.content})
            calls = [{"index": j, **call} for j, call in enumerate(c.parsed.tool_calls)]
            lp = {"content": entries} if r.spec.logprobs else None
            yield chunk(c.index, {"tool_calls": calls}, lp)
        else:
            for piece, entry in zip(c.decoded.pieces_T, entries, strict=True):
                if piece or r.spec.logprobs:
                    lp = {"content": [entry]} if r.spec.logprobs else None
                    yield chunk(c.index, {"content": piece}, lp)
        yield chunk(c.index, {}, None, c.finish_reason)
    if r.spec.include_usage:
        yield usage_chunk(r, obj)


def completion_chunks(r: Result) -> Iterator[dict[str, Any]]:
    obj = "text_completion"
    for c in r.choices:
        s = c.sampled
        offset = 0
        for k, piece in enumerate(c.decoded.pieces_T):
            if not (piece or r.spec.logprobs):
                continue
            logprobs = None
            if r.spec.logprobs:
                top = [s.top_TK[k]] if r.spec.top_logprobs > 0 and s.top_TK else None
                logprobs = legacy_logprobs(
                    r.token_text, [s.tokens_T[k]], [s.logprobs_T[k]], top, [piece], offset
                )
            offset += len(piece)
            choice = {"index": c.index, "text": piece, "logprobs": logprobs, "finish_reason": None}
            yield {**frame(r, obj), "choices": [choice]}
        last = {"index": c.index, "text": "", "logprobs": None, "finish_reason": c.finish_reason}
        yield {**frame(r, obj), "choices": [last]}
    if r.spec.include_usage:
        yield usage_chunk(r, obj)
