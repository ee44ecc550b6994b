"""POST /v1/messages: Anthropic's Messages API, so that agents written against the
`anthropic` client run on a base model, a live training session or a saved checkpoint.

    client = anthropic.Anthropic(base_url="http://127.0.0.1:8000", api_key="tml-...")
    client.messages.create(model="<model_id>", max_tokens=256, messages=[...], tools=[...])

The request becomes a chat completion request (schemas.to_chat) and goes through
/v1/chat/completions' code: `model` resolves the same way (base, model_id, sampling session,
tinker:// checkpoint, GROUP:N), the key is read from `x-api-key` or `Authorization: Bearer`,
and the op is queued and metered as any sample. `X-Treadle-Capture` records the completion
(treadle.server.core.captures). Errors come in Anthropic's shape (anthropic/errors.py).
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from treadle.protocol.ops import sample_sequence_id
from treadle.server.api.anthropic.messages import content_of, message, message_id
from treadle.server.api.anthropic.schemas import MessagesRequest, to_chat
from treadle.server.api.anthropic.stream import live, replay
from treadle.server.api.capture.serving import (
    CaptureDep,
    file_sample,
    record,
    sampler_version,
)
from treadle.server.api.deps import KeyDep, TenantDep
from treadle.server.api.openai.completions import Choice, prepare_chat
from treadle.server.api.openai.routes import ServingDep
from treadle.server.api.openai.sampling import result_of, sampled_of

router = APIRouter(prefix="/v1")


@router.post("/messages")
async def messages(
    body: MessagesRequest,
    serving: ServingDep,
    tenant: TenantDep,
    key: KeyDep,
    capture: CaptureDep,
) -> Response:
    prep = await prepare_chat(serving, tenant, to_chat(body), key)
    state, captures, msg_id = serving.state, serving.captures, message_id()
    version = await sampler_version(captures, prep.target) if capture is not None else ""

    async def on_done(choice: Choice, rid: str, recorded: bool) -> None:
        if capture is not None:
            seq = sample_sequence_id(rid, 0) if recorded else None
            sampled, finish = choice.sampled, choice.finish_reason
            await record(captures, capture, prep, sampled, finish, version, seq)

    keep = capture is not None
    if body.stream and not prep.parse_tools:
        return await live(state, tenant, prep, msg_id, keep, on_done)
    rid, recorded = await file_sample(state, tenant, prep, keep=keep)
    choice = prep.result([sampled_of(await result_of(state, rid))]).choices[0]
    await on_done(choice, rid, recorded)
    if body.stream:
        return replay(msg_id, prep, choice)
    return JSONResponse(message(msg_id, prep, choice, content_of(choice)))
