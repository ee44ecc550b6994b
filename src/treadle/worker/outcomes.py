"""A sample's result as its op's Outcome, and an exception as a failed Outcome.

The shaping the API expects of a sample result happens here, on the engine's side, once:
prompt logprobs cut to what was asked, token usage for metering, and the sampled
sequences recorded for provenance when the request asked for it.
"""

from __future__ import annotations

import logging

from treadle.engine.types import SampleResult
from treadle.protocol.ops import (
    Op,
    Outcome,
    Sample,
    SequenceRecord,
    Usage,
    sample_sequence_id,
)

log = logging.getLogger("treadle.executor")


def failure(op: Op, exc: BaseException) -> Outcome:
    outcome = Outcome.failed(op.request_id, exc)
    if outcome.error.category == "server":
        log.error("request %s (%s) failed", op.request_id, op.kind, exc_info=exc)
    return outcome


def sample_outcome(op: Op, result: SampleResult) -> Outcome:
    p = op.payload
    assert isinstance(p, Sample)
    req = p.request
    if not req.prompt_logprobs:
        result.prompt_logprobs = None
    if req.topk_prompt_logprobs <= 0:
        result.topk_prompt_logprobs = None
    if p.prompt_logprobs_last_n is not None:
        cut = len(req.prompt) - p.prompt_logprobs_last_n  # positions before the last N
        if result.prompt_logprobs:
            result.prompt_logprobs = [None] * cut + list(result.prompt_logprobs[cut:])
        if result.topk_prompt_logprobs:
            result.topk_prompt_logprobs = [None] * cut + list(result.topk_prompt_logprobs[cut:])
    sampled = sum(len(s.tokens) for s in result.sequences)
    cached = result.prompt_cache_hit_tokens  # metered apart, at its own price
    usage = Usage(len(req.prompt) - cached, sampled, cached_prompt_tokens=cached)
    outcome = Outcome.ok(op.request_id, result, usage)
    if p.record is not None:  # record_stability_info: kept with the result, for provenance
        outcome.records = [
            SequenceRecord(
                sample_sequence_id(op.request_id, i),  # as the submit reply listed them
                p.record.tenant_id,
                p.record.session_id,
                list(req.prompt),
                list(s.tokens),
                list(s.logprobs),
            )
            for i, s in enumerate(result.sequences)
        ]
    return outcome
