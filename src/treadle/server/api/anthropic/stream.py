"""/v1/messages with stream=true: Anthropic's server-sent events.

    message_start → content_block_start → ping → content_block_delta ... → content_block_stop
    (→ a tool_use block: start, one input_json_delta, stop) → message_delta → message_stop

An answer without tools streams as it is sampled: the sample op reports its tokens after each
decode step (as /v1's live streams), and text goes out once final (render.LiveText: never half
a character, never the start of a stop sequence that may still complete). The stream starts
only once the first token (or the op's end) is in, so an error before it is an ordinary JSON
error reply; one after it is an `error` event. A client that goes away cancels the op.

An answer with tools is sampled whole (a call is known only once its closing tag is out) and
replayed: its text, then each tool_use block with its input as one JSON delta.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi.responses import StreamingResponse

from treadle.errors import TreadleError
from treadle.server.api.anthropic.errors import error_body
from treadle.server.api.anthropic.messages import content_of, stop_of, usage
from treadle.server.api.capture.serving import file_sample
from treadle.server.api.openai.completions import Choice, Prepared
from treadle.server.api.openai.render import LiveText
from treadle.server.api.openai.sampling import result_of, sampled_of
from treadle.server.core.cancellation import cancel_ops
from treadle.server.core.state import ServerState
from treadle.server.tenancy.auth import Tenant

log = logging.getLogger("treadle.anthropic")
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

# called once the answer is whole, before message_stop: (choice, request_id, recorded)
OnDone = Callable[[Choice, str, bool], Awaitable[None]]


def event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


def _start(msg_id: str, prep: Prepared) -> str:
    head = {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "model": prep.model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage(len(prep.prompts_P[0]), 0),
    }
    return event("message_start", {"message": head})


def _end(prep: Prepared, choice: Choice) -> list[str]:
    reason, sequence = stop_of(prep, choice)
    delta = {"stop_reason": reason, "stop_sequence": sequence}
    out_usage = {"output_tokens": len(choice.sampled.tokens_T)}
    return [event("message_delta", {"delta": delta, "usage": out_usage}), event("message_stop", {})]


def replay(msg_id: str, prep: Prepared, choice: Choice) -> StreamingResponse:
    """The events of a whole answer."""
    events = [_start(msg_id, prep)]
    for i, block in enumerate(content_of(choice)):
        if block["type"] == "text":
            events.append(
                event("content_block_start", {"index": i, "content_block": {**block, "text": ""}})
            )
            delta = {"type": "text_delta", "text": block["text"]}
        else:
            events.append(
                event("content_block_start", {"index": i, "content_block": {**block, "input": {}}})
            )
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        events.append(event("content_block_delta", {"index": i, "delta": delta}))
        events.append(event("content_block_stop", {"index": i}))
    events += _end(prep, choice)
    return StreamingResponse(iter(events), media_type="text/event-stream", headers=HEADERS)


async def live(
    state: ServerState, tenant: Tenant, prep: Prepared, msg_id: str, keep: bool, on_done: OnDone
) -> StreamingResponse:
    """File the op and answer with its events once the first token (or its end) is in."""
    rid, recorded = await file_sample(state, tenant, prep, stream=True, keep=keep)
    updates = state.futures.updates(rid).__aiter__()
    try:
        first = await anext(updates, None)
        if first is None:  # over before its first token: its error is a plain reply
            await result_of(state, rid)
    except BaseException:
        _cancel(state, prep, rid)
        raise
    body = _events(state, prep, msg_id, rid, recorded, first, updates, on_done)
    return StreamingResponse(body, media_type="text/event-stream", headers=HEADERS)


async def _events(
    state: ServerState,
    prep: Prepared,
    msg_id: str,
    rid: str,
    recorded: bool,
    item: Any,
    updates: AsyncIterator,
    on_done: OnDone,
) -> AsyncIterator[str]:
    over = False
    try:
        yield _start(msg_id, prep)
        yield event(
            "content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}
        )
        yield event("ping", {})
        text = LiveText(prep.tok, prep.spec.stop)
        while item is not None:
            for _j, pos, token, _lp in item.tokens:
                if pos != len(text.tokens):  # the op ran again: already sent
                    continue
                piece = text.push(token)
                if piece:
                    yield _delta(piece)
            item = await anext(updates, None)
        try:
            sampled = sampled_of(await result_of(state, rid))
        except TreadleError as e:
            over = True
            yield event("error", {"error": error_body(str(e), e.status)["error"]})
            return
        over = True
        choice = prep.choices(0, sampled)[0]
        rest = text.finish(choice.decoded.text)
        if rest:
            yield _delta(rest)
        yield event("content_block_stop", {"index": 0})
        await on_done(choice, rid, recorded)
        for e in _end(prep, choice):
            yield e
    finally:
        if not over:
            _cancel(state, prep, rid)


def _delta(text: str) -> str:
    return event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": text}})


def _cancel(state: ServerState, prep: Prepared, rid: str) -> None:
    engine = state.engines.get(prep.target.base_model)
    name = engine.name if engine is not None else None
    task = asyncio.get_running_loop().create_task(cancel_ops(state, [rid], name))
    task.add_done_callback(_log_failure)


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("could not cancel the op of a closed stream: %s", task.exception())
