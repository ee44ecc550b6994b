"""Sampling for the /v1 routes, through the Service's own path: the request is checked by
`to_engine_sample_request` and filed with `Service.submit` like an asample, so it is
queued, batched with everyone else's, recorded and metered the same way; its future is
awaited through `Service.retrieve`, as a client's retrieve_future would.

Seeds map one to one: `seed` here is `SamplingParams.seed` there, and `n` is
`num_samples`, so a request with a seed returns the very tokens that `SamplingClient.sample`
returns for the same prompt tokens and settings.

top_logprobs need the whole distribution at each sampled position, which a decode step does
not keep: they come from a second, scoring-only pass over prompt + completion (the
raw-distribution logprobs the sampler reports, so the two agree).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from treadle.engine.types import SampleRequest as EngineSampleRequest
from treadle.engine.types import SampleSpec
from treadle.errors import InvalidRequestError, NotFoundError, QuotaExceededError, TreadleError
from treadle.server.executor import PROTO_TYPE
from treadle.server.openai.resolve import Target
from treadle.server.openai.schemas import Sampling
from treadle.server.service import Service
from treadle.server.validation import to_engine_sample_request
from treadle.types import ModelInput, SampleResponse, SamplingParams
from treadle.wire import codec
from treadle.wire.requests import SampleRequest


@dataclass
class Sampled:
    """One choice: its tokens, their logprobs, why it ended, and the top-K at each token."""

    tokens_T: list[int]
    logprobs_T: list[float]
    stop_reason: str
    top_TK: list[list[tuple[int, float]]] | None = None


def check_room(
    svc: Service, target: Target, prompt_T: list[int], spec: Sampling, field: str
) -> int:
    """→ max_tokens: the one asked for, or all the room the context leaves."""
    _, max_len = svc.engine_facts(target.base_model)
    P = len(prompt_T)
    if P == 0:
        raise InvalidRequestError(f"{field}: renders to no tokens")
    if P >= max_len:
        raise InvalidRequestError(
            f"{field}: {P} prompt tokens leave no room to sample (the context of "
            f"{target.base_model!r} is {max_len} tokens)"
        )
    room = max_len - P
    if spec.max_tokens is None:  # all the room, or what the server's input limits allow
        default = getattr(svc, "default_max_tokens", lambda *_: None)(target.base_model, P)
        return room if default is None else min(room, default)
    if spec.max_tokens > room:
        raise InvalidRequestError(
            f"max_tokens: expected 1..{room} (the context {max_len} minus {P} prompt tokens), "
            f"got {spec.max_tokens}"
        )
    return spec.max_tokens


async def sample(
    svc: Service, target: Target, prompt_T: list[int], spec: Sampling, max_tokens: int
) -> list[Sampled]:
    """`spec.n` continuations of one prompt (and their top-K logprobs if asked)."""
    base = target.base_model
    vocab, max_len = svc.engine_facts(base)
    body = SampleRequest(
        num_samples=spec.n,
        prompt=ModelInput.from_ints(prompt_T),
        sampling_params=SamplingParams(
            max_tokens=max_tokens,
            seed=spec.seed,
            stop=spec.stop or None,
            temperature=spec.temperature,
            top_k=spec.top_k,
            top_p=spec.top_p,
        ),
        sampling_session_id=target.sampling_session_id,
    )
    request = to_engine_sample_request(body, target.adapter, vocab, max_len)
    resp = await _run(svc, target, request)
    out = [Sampled(s.tokens, list(s.logprobs or []), s.stop_reason) for s in resp.sequences]
    if spec.top_logprobs > 0:
        tops = await asyncio.gather(
            *(_top_k(svc, target, prompt_T, s.tokens_T, spec.top_logprobs) for s in out)
        )
        for s, top in zip(out, tops, strict=True):
            s.top_TK = top
    return out


async def _top_k(
    svc: Service, target: Target, prompt_T: list[int], tokens_T: list[int], k: int
) -> list[list[tuple[int, float]]]:
    if not tokens_T:
        return []
    request = EngineSampleRequest(
        prompt=prompt_T + tokens_T,
        num_samples=1,
        params=SampleSpec(max_tokens=0),
        adapter=target.adapter,
        topk_prompt_logprobs=k,
    )
    resp = await _run(svc, target, request)
    top = resp.topk_prompt_logprobs or []
    return [list(map(tuple, row or [])) for row in top[len(prompt_T) :]]


async def _run(svc: Service, target: Target, request: EngineSampleRequest) -> SampleResponse:
    rid = await svc.submit(
        svc.workers[target.base_model],
        "sample",
        {"request": request, "prompt_logprobs_last_n": None},
        session_id=target.session_id,
        sampling_session_id=target.sampling_session_id,
    )
    while True:
        body, content_type = await svc.retrieve(rid, want_proto=True)
        if content_type == PROTO_TYPE:
            return codec.decode_sample_response(body)
        data = json.loads(body)
        if data.get("type") == "try_again":
            continue
        if "error" in data:
            raise _error_of(data)
        return SampleResponse.model_validate(data)


def _error_of(data: dict) -> TreadleError:
    message = str(data.get("error"))
    if data.get("category") != "user":
        return TreadleError(f"sampling failed: {message}")
    if "not found" in message or "freed" in message or "unloaded" in message:
        return NotFoundError(f"model: {message}")
    if "quota" in message.lower():
        return QuotaExceededError(message)
    return InvalidRequestError(message)
