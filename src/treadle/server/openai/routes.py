"""OpenAI-compatible routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models.

    client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="tml-...")
    client.chat.completions.create(model="<model_id of a training session>", messages=[...])

Errors on these paths come in OpenAI's shape (treadle.server.openai.errors, applied by the
app's error handler).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from treadle.server.deps import ServiceDep, TenantDep
from treadle.server.openai.completions import (
    OpenAIState,
    chat_response,
    completion_response,
    run_chat,
    run_completion,
)
from treadle.server.openai.render import Tokenizers
from treadle.server.openai.resolve import list_models, model_entry, resolve
from treadle.server.openai.schemas import ChatCompletionRequest, CompletionRequest
from treadle.server.openai.stream import chat_chunks, completion_chunks, streaming_response

router = APIRouter(prefix="/v1")


async def get_state(request: Request, svc: ServiceDep) -> OpenAIState:
    state = getattr(request.app.state, "openai", None)
    if state is None:
        folders = {name: str(path) for name, path in svc.config.models.items()}
        state = request.app.state.openai = OpenAIState(Tokenizers(folders))
    return state


StateDep = Annotated[OpenAIState, Depends(get_state)]


async def get_encryption_key(request: Request) -> bytes | None:
    """The tenant's key for encrypted checkpoint versions, if the request carries one."""
    try:
        from treadle.server import encryption
    except ImportError:
        return None
    return encryption.parse_key(request.headers.get(encryption.HEADER))


KeyDep = Annotated[bytes | None, Depends(get_encryption_key)]


@router.get("/models")
async def models(svc: ServiceDep, tenant: TenantDep) -> dict[str, Any]:
    return {"object": "list", "data": await list_models(svc, tenant.tenant_id)}


@router.get("/models/{model:path}")
async def model(model: str, svc: ServiceDep, state: StateDep, tenant: TenantDep) -> dict:
    target = await resolve(svc, state.checkpoints, tenant.tenant_id, model, load=False)
    owner = "treadle" if target.base_model == model else tenant.tenant_id
    return model_entry(model, owner, target.base_model, target.created)


@router.post("/chat/completions")
async def chat_completions(
    body: ChatCompletionRequest, svc: ServiceDep, state: StateDep, tenant: TenantDep, key: KeyDep
) -> Response:
    result = await run_chat(svc, state, tenant.tenant_id, body, key)
    if body.stream:
        return streaming_response(chat_chunks(result))
    return JSONResponse(chat_response(result))


@router.post("/completions")
async def completions(
    body: CompletionRequest, svc: ServiceDep, state: StateDep, tenant: TenantDep, key: KeyDep
) -> Response:
    result = await run_completion(svc, state, tenant.tenant_id, body, key)
    if body.stream:
        return streaming_response(completion_chunks(result))
    return JSONResponse(completion_response(result))
