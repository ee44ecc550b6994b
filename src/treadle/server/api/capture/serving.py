"""Serving a completion under a capture session.

`capture_of` reads `X-Treadle-Capture` (and `X-Treadle-Trajectory`) from a /v1 or
/v1/messages request; the capture is created for the tenant if it has none of that name.
`file_sample` files the sample op as the /v1 routes do (same validator, queue, limits and
metering), and, when the weights are a training session's, with record_stability_info, so
that the sampled sequence is kept for stable_reinforce's provenance. `record` commits the
completion before the response leaves.

A captured request samples one choice (n = 1): a trajectory continues one answer.
"""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import Depends, Request

from treadle.errors import InvalidRequestError
from treadle.protocol.ops import OpKind, RecordTo, Sample, sample_sequence_id
from treadle.server.api.deps import get_tenant
from treadle.server.api.openai.completions import Prepared, Result
from treadle.server.api.openai.resolve import Target
from treadle.server.api.openai.sampling import Sampled, engine_request, result_of, sampled_of
from treadle.server.core.captures import Captured, CaptureRef, Captures, check_name
from treadle.server.core.state import ServerState
from treadle.server.tenancy.auth import Tenant

CAPTURE_HEADER = "X-Treadle-Capture"
TRAJECTORY_HEADER = "X-Treadle-Trajectory"


async def capture_of(request: Request) -> CaptureRef | None:
    """The capture a request is served under, from its headers (None: not captured)."""
    name = request.headers.get(CAPTURE_HEADER)
    trajectory = request.headers.get(TRAJECTORY_HEADER)
    if not name:
        if trajectory:
            raise InvalidRequestError(f"{TRAJECTORY_HEADER}: only with {CAPTURE_HEADER}")
        return None
    check_name(name, CAPTURE_HEADER)
    if trajectory:
        check_name(trajectory, TRAJECTORY_HEADER)
    tenant = await get_tenant(request)
    captures: Captures = request.app.state.openai.captures
    await captures.create(tenant.tenant_id, name)
    return CaptureRef(tenant.tenant_id, name, trajectory or None)


CaptureDep = Annotated[CaptureRef | None, Depends(capture_of)]


def check_one_choice(prep: Prepared) -> None:
    if prep.spec.n != 1 or len(prep.prompts_P) != 1:
        raise InvalidRequestError(
            f"n: a request under {CAPTURE_HEADER} samples one choice of one prompt (a "
            f"trajectory continues one answer), got n={prep.spec.n} and "
            f"{len(prep.prompts_P)} prompts"
        )


async def sampler_version(captures: Captures, target: Target) -> str:
    """The weights that sample: a live training model's model_id and optimizer steps done
    when the request was filed; a sampling session's, a checkpoint's or a base's name."""
    if target.session_id is not None and target.sampling_session_id is None and target.adapter:
        return f"{target.adapter}@step:{await captures.optim_steps(target.adapter)}"
    return target.sampling_session_id or target.name


async def file_sample(
    state: ServerState, tenant: Tenant, prep: Prepared, stream: bool = False, keep: bool = True
) -> tuple[str, bool]:
    """File the one prompt's sample op (`stream`: reporting its tokens as they come, with a
    seed, as /v1's live streams); `keep`: record its sequence for provenance when the
    weights are a training session's. → (request_id, whether its sequence is recorded)."""
    target, spec = prep.target, prep.spec
    seed = spec.seed if spec.seed is not None or not stream else secrets.randbits(63)
    request = engine_request(state, target, prep.prompts_P[0], spec, prep.max_tokens_P[0], seed)
    keep = keep and target.session_id is not None
    record = RecordTo(tenant.tenant_id, target.session_id) if keep and target.session_id else None
    rid = await state.futures.file(
        state.engines.require(target.base_model),
        OpKind.SAMPLE,
        Sample(request, record=record, stream=stream),
        tenant=tenant,
        session_id=target.session_id,
        sampling_session_id=target.sampling_session_id,
    )
    return rid, record is not None


async def record(
    captures: Captures,
    ref: CaptureRef,
    prep: Prepared,
    sampled: Sampled,
    finish_reason: str,
    version: str,
    sequence_id: str | None,
) -> str:
    done = Captured(
        model=prep.model,
        base_model=prep.target.base_model,
        sampler_version=version,
        session_id=prep.target.session_id,
        sequence_id=sequence_id,
        prompt_T=prep.prompts_P[0],
        tokens_T=sampled.tokens_T,
        logprobs_T=sampled.logprobs_T,
        finish_reason=finish_reason,
    )
    return await captures.record(ref, done)


async def run_captured(
    state: ServerState, captures: Captures, tenant: Tenant, prep: Prepared, ref: CaptureRef
) -> Result:
    """Sample the request whole and record it; → the result, as `completions.run` gives."""
    check_one_choice(prep)
    version = await sampler_version(captures, prep.target)
    rid, recorded = await file_sample(state, tenant, prep)
    sampled = sampled_of(await result_of(state, rid))
    result = prep.result([sampled])
    choice = result.choices[0]
    seq = sample_sequence_id(rid, 0) if recorded else None
    await record(captures, ref, prep, choice.sampled, choice.finish_reason, version, seq)
    return result
