"""Input limits of one request (config `limits`, 400 beyond) and the per-tenant token quota
(429 beyond), checked where every route's operations pass (Service.submit), so that the
Tinker routes and the OpenAI-compatible ones are held to the same limits."""

from __future__ import annotations

from typing import Any

from treadle.errors import InvalidRequestError
from treadle.server.config import InputLimits
from treadle.server.quotas import over

TRAIN_KINDS = ("forward_backward", "forward")


def request_tokens(
    limits: InputLimits, base_model: str, kind: str, payload: Any
) -> tuple[int, str] | None:
    """Check an operation against the input limits; → (its tokens, what they are) for the
    token quota, or None for operations that carry no tokens."""
    if not isinstance(payload, dict):  # an op that carries no data (skip, control)
        return None
    max_len = limits.max_seq_len.get(base_model)
    if kind in TRAIN_KINDS:
        lengths = [d.model_input.length for d in payload["data"]]
        tokens = sum(lengths)
        if max_len is not None and max(lengths) > max_len:
            i = lengths.index(max(lengths))
            raise InvalidRequestError(
                f"data[{i}].model_input: length {lengths[i]} exceeds the input limit "
                f"max_seq_len {max_len} of model {base_model!r}"
            )
        if limits.max_batch_tokens is not None and tokens > limits.max_batch_tokens:
            raise InvalidRequestError(
                f"data: {tokens} tokens in one request exceed the input limit "
                f"max_batch_tokens {limits.max_batch_tokens}; send a smaller batch"
            )
        return tokens, "model-input tokens"
    if kind != "sample":
        return None
    req = payload["request"]
    n, max_tokens, prompt = req.num_samples, req.params.max_tokens, len(req.prompt)
    if n > limits.max_num_samples:
        raise InvalidRequestError(
            f"num_samples: {n} exceeds the input limit max_num_samples {limits.max_num_samples}"
        )
    if limits.max_sample_tokens is not None and max_tokens > limits.max_sample_tokens:
        raise InvalidRequestError(
            f"sampling_params.max_tokens: {max_tokens} exceeds the input limit "
            f"max_sample_tokens {limits.max_sample_tokens}"
        )
    if max_len is not None and prompt + max_tokens > max_len:
        raise InvalidRequestError(
            f"prompt: {prompt} prompt tokens + max_tokens {max_tokens} exceed the input "
            f"limit max_seq_len {max_len} of model {base_model!r}"
        )
    return prompt + n * max_tokens, "prompt + num_samples × max_tokens"


def check_request(
    limits: InputLimits, quota: int | None, base_model: str, kind: str, payload: Any
) -> None:
    """Input limits (InvalidRequestError) and the max_tokens_per_request quota (QuotaError)."""
    counted = request_tokens(limits, base_model, kind, payload)
    if counted is None or quota is None or counted[0] <= quota:
        return
    tokens, what = counted
    raise over(
        "max_tokens_per_request",
        quota,
        f"this request has {tokens} {what}",
        "send smaller requests",
        None,
    )


def default_max_tokens(
    limits: InputLimits, base_model: str, context: int, prompt_len: int
) -> int | None:
    """max_tokens for a sample request that gives none: the room the limits leave (None
    without limits: the room the model's context leaves, as before)."""
    if limits.max_sample_tokens is None and base_model not in limits.max_seq_len:
        return None
    room = min(context, limits.max_seq_len.get(base_model, context)) - prompt_len
    if limits.max_sample_tokens is not None:
        room = min(room, limits.max_sample_tokens)
    return max(room, 1)
