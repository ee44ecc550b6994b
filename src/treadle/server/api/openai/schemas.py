"""Request bodies of the /v1 routes, and the checks that name the offending field.

Unknown fields are accepted and ignored (clients send `user`, `metadata`, `store`, ...);
fields whose meaning this server cannot honour (penalties, logit_bias, JSON mode, forced
tool choice) are refused with a 400 naming them, rather than silently dropped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict

from treadle.errors import InvalidRequestError
from treadle.server.core.validation import MAX_NUM_SAMPLES

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat; /v1/completions allows 5
MAX_LEGACY_LOGPROBS = 5


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class ChatMessage(_Body):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class _Sampling(_Body):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # extensions that vLLM's server also takes
    top_k: int | None = None
    return_token_ids: bool | None = False
    ignore_eos: bool | None = False  # generate through end-of-sequence tokens


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None


@dataclass
class Sampling:
    """What one request asks of the sampler, checked; max_tokens None means 'up to the
    context limit' (decided once the prompt length is known)."""

    max_tokens: int | None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    n: int = 1
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    include_usage: bool = False
    ignore_eos: bool = False


def _refuse_unsupported(body: _Sampling) -> None:
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(body, name)
        if value not in (None, 0, 0.0):
            raise InvalidRequestError(f"{name}: not supported by this server (send 0), got {value}")
    if body.logit_bias:
        raise InvalidRequestError("logit_bias: not supported by this server (send {} or omit it)")


def _common(body: _Sampling, max_tokens: int | None) -> Sampling:
    _refuse_unsupported(body)
    if not body.model:
        raise InvalidRequestError("model: required, got an empty string")
    if max_tokens is not None and max_tokens < 1:
        raise InvalidRequestError(f"max_tokens: expected >= 1, got {max_tokens}")
    temperature = 1.0 if body.temperature is None else body.temperature
    if not (math.isfinite(temperature) and 0 <= temperature <= 2):
        raise InvalidRequestError(f"temperature: expected a number in [0, 2], got {temperature}")
    top_p = 1.0 if body.top_p is None else body.top_p
    if not 0 < top_p <= 1:
        raise InvalidRequestError(f"top_p: expected a number in (0, 1], got {top_p}")
    top_k = -1 if body.top_k in (None, 0) else body.top_k
    if top_k < -1:
        raise InvalidRequestError(f"top_k: expected -1 (off) or >= 1, got {top_k}")
    n = 1 if body.n is None else body.n
    if not 1 <= n <= MAX_NUM_SAMPLES:
        raise InvalidRequestError(f"n: expected 1..{MAX_NUM_SAMPLES}, got {n}")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    for i, s in enumerate(stop):
        if not s:
            raise InvalidRequestError(f"stop[{i}]: expected a non-empty string, got {s!r}")
    if body.stream_options is not None and not body.stream:
        raise InvalidRequestError("stream_options: only allowed with stream=true")
    include_usage = bool((body.stream_options or {}).get("include_usage"))
    if body.ignore_eos and stop:
        raise InvalidRequestError("ignore_eos: not with stop strings (send one or the other)")
    return Sampling(
        max_tokens,
        temperature,
        top_p,
        top_k,
        n,
        stop,
        body.seed,
        include_usage=include_usage,
        ignore_eos=bool(body.ignore_eos),
    )


def check_chat(body: ChatCompletionRequest) -> Sampling:
    if not body.messages:
        raise InvalidRequestError("messages: expected at least one message, got none")
    max_tokens = body.max_completion_tokens
    if max_tokens is None:
        max_tokens = body.max_tokens
    elif max_tokens < 1:
        raise InvalidRequestError(f"max_completion_tokens: expected >= 1, got {max_tokens}")
    spec = _common(body, max_tokens)
    top = body.top_logprobs or 0
    if top and not body.logprobs:
        raise InvalidRequestError("top_logprobs: needs logprobs=true")
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise InvalidRequestError(f"top_logprobs: expected 0..{MAX_TOP_LOGPROBS}, got {top}")
    spec.logprobs, spec.top_logprobs = bool(body.logprobs), top
    fmt = (body.response_format or {}).get("type", "text")
    if fmt != "text":
        raise InvalidRequestError(
            f"response_format: only {{'type': 'text'}} is supported, got type {fmt!r}"
        )
    if body.tool_choice not in (None, "auto", "none"):
        raise InvalidRequestError(
            f"tool_choice: only 'auto' and 'none' are supported (a model cannot be forced to "
            f"call a tool here), got {body.tool_choice!r}"
        )
    for i, tool in enumerate(body.tools or []):
        fn = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise InvalidRequestError(
                f"tools[{i}]: expected {{'type': 'function', 'function': {{...}}}}, got {tool!r}"
            )
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidRequestError(f"tools[{i}].function.name: required, got {fn.get('name')!r}")
    return spec


def check_completion(body: CompletionRequest) -> Sampling:
    if body.echo:
        raise InvalidRequestError("echo: not supported by this server (send false)")
    if body.suffix:
        raise InvalidRequestError("suffix: not supported by this server (omit it)")
    if body.best_of not in (None, 1) and body.best_of != body.n:
        raise InvalidRequestError(f"best_of: only best_of == n is supported, got {body.best_of}")
    spec = _common(body, 16 if body.max_tokens is None else body.max_tokens)
    if body.logprobs is not None:
        if not 0 <= body.logprobs <= MAX_LEGACY_LOGPROBS:
            raise InvalidRequestError(
                f"logprobs: expected 0..{MAX_LEGACY_LOGPROBS}, got {body.logprobs}"
            )
        spec.logprobs, spec.top_logprobs = True, body.logprobs
    return spec


def prompts_of(body: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a completion request: strings, or token id lists."""
    p = body.prompt
    if isinstance(p, str):
        prompts: list[str | list[int]] = [p]
    elif p and all(isinstance(x, int) for x in p):
        prompts = [list(p)]  # type: ignore[arg-type]
    else:
        prompts = list(p)  # type: ignore[arg-type]
    if not prompts:
        raise InvalidRequestError("prompt: expected a string or a list of them, got []")
    for i, one in enumerate(prompts):
        if len(one) == 0:
            raise InvalidRequestError(f"prompt[{i}]: expected a non-empty prompt, got {one!r}")
    return prompts
