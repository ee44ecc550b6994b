"""Sampling for the /v1 routes, through the same path as asample: the request is checked by
the same validator and filed as a sample op with `Futures.file`, so it is queued, batched
with everyone else's, recorded and metered the same way; its typed result is awaited with
`Futures.result`, which raises the engine's error as its own class (a 404 stays a 404, a
quota's 429 a 429). No protobuf on this path.

Seeds map one to one: `seed` here is `SamplingParams.seed` there, and `n` is
`num_samples`, so a request with a seed returns the very tokens that `SamplingClient.sample`
returns for the same prompt tokens and settings.

top_logprobs are the sampler's own top-K at each sampled position (`topk_sample_logprobs`,
of the raw distribution, like the sampled logprobs): one pass, on the weights the request
was filed against, even on a live session whose next optim_step lands meanwhile.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from treadle.engine.types import SampleRequest as EngineSampleRequest
from treadle.engine.types import SampleResult
from treadle.errors import InvalidRequestError
from treadle.protocol.ops import OpKind, Sample
from treadle.server.api.openai.resolve import Target
from treadle.server.api.openai.schemas import Sampling
from treadle.server.core import validation
from treadle.server.core.state import ServerState
from treadle.server.tenancy.auth import Tenant
from treadle.types import ModelInput, SamplingParams
from treadle.wire.requests import SampleRequest


@dataclass
class Sampled:
    """One choice: its tokens, their logprobs, why it ended, the top-K at each token, and
    the logprobs under the distribution they were drawn from (where that is not the raw
    one: temperature, filters or controls)."""

    tokens_T: list[int]
    logprobs_T: list[float]
    stop_reason: str
    top_TK: list[list[tuple[int, float]]] | None = None
    sampling_logprobs_T: list[float] | None = None
    prompt_cached: int = 0  # its prompt's tokens the prefix cache held (per prompt, not choice)


def check_room(
    state: ServerState, target: Target, prompt_T: list[int], spec: Sampling, field: str
) -> int:
    """→ max_tokens: the one asked for, or all the room the context leaves."""
    max_len = state.engines.facts(target.base_model).max_seq_len
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
        default = state.admission.default_max_tokens(target.base_model, max_len, P)
        return room if default is None else min(room, default)
    if spec.max_tokens > room:
        raise InvalidRequestError(
            f"max_tokens: expected 1..{room} (the context {max_len} minus {P} prompt tokens), "
            f"got {spec.max_tokens}"
        )
    return spec.max_tokens


def engine_request(
    state: ServerState,
    target: Target,
    prompt_T: list[int],
    spec: Sampling,
    max_tokens: int,
    seed: int | None,
    tenant_id: str = "",
) -> EngineSampleRequest:
    """The engine's request for `spec.n` continuations of one prompt, checked by the same
    validator as asample's."""
    facts = state.engines.facts(target.base_model)
    for t in spec.logit_bias:
        if t >= facts.vocab_size:
            raise InvalidRequestError(
                f"logit_bias: token id {t} is outside the vocabulary [0, {facts.vocab_size})"
            )
    body = SampleRequest(
        num_samples=spec.n,
        prompt=ModelInput.from_ints(prompt_T),
        sampling_params=SamplingParams(
            max_tokens=max_tokens,
            seed=seed,
            stop=[] if spec.ignore_eos else spec.stop or None,  # [] ignores EOS
            temperature=spec.temperature,
            top_k=spec.top_k,
            top_p=spec.top_p,
            **_controls(spec),
        ),
        sampling_session_id=target.sampling_session_id,
        topk_sample_logprobs=spec.top_logprobs,
    )
    return validation.sample_request(
        body, target.adapter, facts, None, state.config.limits, scope=tenant_id
    )


def _controls(spec: Sampling) -> dict[str, Any]:
    """The request's sampling controls as SamplingParams fields (None where unused)."""
    out: dict[str, Any] = {
        "min_p": spec.min_p or None,
        "logit_bias": spec.logit_bias or None,
        "presence_penalty": spec.presence_penalty or None,
        "frequency_penalty": spec.frequency_penalty or None,
        "repetition_penalty": None if spec.repetition_penalty == 1.0 else spec.repetition_penalty,
    }
    if spec.constraint is not None:
        out[spec.constraint.kind] = spec.constraint.source
    return out


def sampled_of(result: SampleResult) -> list[Sampled]:
    hit = result.prompt_cache_hit_tokens
    return [
        Sampled(s.tokens, list(s.logprobs or []), s.stop_reason, s.topk, s.sampling_logprobs, hit)
        for s in result.sequences
    ]


async def sample(
    state: ServerState,
    tenant: Tenant,
    target: Target,
    prompt_T: list[int],
    spec: Sampling,
    max_tokens: int,
) -> list[Sampled]:
    """`spec.n` continuations of one prompt (and their top-K logprobs if asked)."""
    request = engine_request(state, target, prompt_T, spec, max_tokens, spec.seed, tenant.tenant_id)
    return sampled_of(await _run(state, tenant, target, request))


async def file_streamed(
    state: ServerState,
    tenant: Tenant,
    target: Target,
    prompt_T: list[int],
    spec: Sampling,
    max_tokens: int,
) -> str:
    """File a sample op that reports its tokens as they come (Futures.updates): → its
    request_id. Without a seed it gets one here, kept in its op log entry, so that a run
    again (its worker restarted) samples the same tokens and a stream that already sent
    some of them carries on without repeating or contradicting itself."""
    seed = spec.seed if spec.seed is not None else secrets.randbits(63)
    request = engine_request(state, target, prompt_T, spec, max_tokens, seed, tenant.tenant_id)
    return await _file(state, tenant, target, Sample(request, stream=True))


async def _run(
    state: ServerState, tenant: Tenant, target: Target, request: EngineSampleRequest
) -> SampleResult:
    return await result_of(state, await _file(state, tenant, target, Sample(request)))


async def _file(state: ServerState, tenant: Tenant, target: Target, payload: Sample) -> str:
    return await state.futures.file(
        state.engines.require(target.base_model),
        OpKind.SAMPLE,
        payload,
        tenant=tenant,
        session_id=target.session_id,
        sampling_session_id=target.sampling_session_id,
    )


async def result_of(state: ServerState, request_id: str) -> SampleResult:
    """A sample future's result (its error raised as its own class)."""
    result = await state.futures.result(request_id)
    assert isinstance(result, SampleResult)
    return result
