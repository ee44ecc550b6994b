"""OpenAI-compatible routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models.

    client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="tml-...")
    client.chat.completions.create(model="<model_id of a training session>", messages=[...])

With `X-Treadle-Capture` the completion is recorded (treadle.server.core.captures): it is
sampled whole, and a stream replays it.

Errors on these paths come in OpenAI's shape (treadle.server.api.openai.errors, applied by the
app's error handler).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from treadle.server.api.capture.serving import CaptureDep, run_captured
from treadle.server.api.deps import KeyDep, TenantDep
from treadle.server.api.openai.completions import (
    chat_response,
    completion_response,
    prepare_chat,
    prepare_completion,
    run,
)
from treadle.server.api.openai.live import live_response, streams_live
from treadle.server.api.openai.resolve import list_models, model_entry, resolve
from treadle.server.api.openai.schemas import ChatCompletionRequest, CompletionRequest
from treadle.server.api.openai.serving import OpenAIServing
from treadle.server.api.openai.stream import chat_chunks, completion_chunks, streaming_response

router = APIRouter(prefix="/v1")


async def get_serving(request: Request) -> OpenAIServing:
    return request.app.state.openai


ServingDep = Annotated[OpenAIServing, Depends(get_serving)]


@router.get("/models")
async def models(serving: ServingDep, tenant: TenantDep) -> dict[str, Any]:
    return {"object": "list", "data": await list_models(serving.state, tenant.tenant_id)}


@router.get("/models/{model:path}")
async def model(model: str, serving: ServingDep, tenant: TenantDep) -> dict:
    target = await resolve(serving.state, serving.checkpoints, tenant.tenant_id, model, load=False)
    owner = "treadle" if target.base_model == model else tenant.tenant_id
    return model_entry(model, owner, target.base_model, target.created)


@router.post("/chat/completions")
async def chat_completions(
    body: ChatCompletionRequest,
    serving: ServingDep,
    tenant: TenantDep,
    key: KeyDep,
    capture: CaptureDep,
) -> Response:
    prep = await prepare_chat(serving, tenant, body, key)
    if capture is not None:
        result = await run_captured(serving.state, serving.captures, tenant, prep, capture)
    elif body.stream and streams_live(prep, chat=True):
        return await live_response(serving.state, tenant, prep, chat=True)
    else:
        result = await run(serving, tenant, prep)
    if body.stream:
        return streaming_response(chat_chunks(result))
    return JSONResponse(chat_response(result))


@router.post("/completions")
async def completions(
    body: CompletionRequest,
    serving: ServingDep,
    tenant: TenantDep,
    key: KeyDep,
    capture: CaptureDep,
) -> Response:
    prep = await prepare_completion(serving, tenant, body, key)
    if capture is not None:
        result = await run_captured(serving.state, serving.captures, tenant, prep, capture)
    elif body.stream and streams_live(prep, chat=False):
        return await live_response(serving.state, tenant, prep, chat=False)
    else:
        result = await run(serving, tenant, prep)
    if body.stream:
        return streaming_response(completion_chunks(result))
    return JSONResponse(completion_response(result))
