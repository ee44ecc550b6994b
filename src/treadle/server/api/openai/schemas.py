"""Request bodies of the /v1 routes, and the checks that name the offending field.

Unknown fields are accepted and ignored (clients send `user`, `metadata`, `store`, ...);
fields whose meaning this server cannot honour (forced tool choice, guided_choice) are
refused with a 400 naming them, rather than silently dropped. Sampling controls
(docs/sampling.md): OpenAI's logit_bias, presence_penalty, frequency_penalty and
response_format (json_object, json_schema); vLLM's min_p, repetition_penalty and
constraints (guided_json / guided_regex / guided_grammar, or structured_outputs with
json / regex / grammar / json_object).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict

from treadle.engine.constraints import check_constraint
from treadle.engine.specs import (
    MAX_ABS_PRESENCE_PENALTY,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_REPETITION_PENALTY,
)
from treadle.engine.types import Constraint
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
    min_p: float | None = None
    repetition_penalty: float | None = None
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None
    structured_outputs: dict[str, Any] | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None


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
    min_p: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    constraint: Constraint | None = None


def _number(name: str, value: float | None, default: float, lo: float, hi: float) -> float:
    """A control in [lo, hi] (lo excluded where it is 0 and the default 1: a ratio)."""
    if value is None:
        return default
    open_lo = lo == 0 and default == 1
    ok = math.isfinite(value) and (lo < value if open_lo else lo <= value) and value <= hi
    if not ok:
        span = f"({lo:g}, {hi:g}]" if open_lo else f"[{lo:g}, {hi:g}]"
        raise InvalidRequestError(f"{name}: expected a number in {span}, got {value}")
    return float(value)


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's logit_bias: token ids (as strings) → a bias in [-100, 100]; the ids are
    checked against the vocabulary once the model is known."""
    out: dict[int, float] = {}
    if len(bias or {}) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidRequestError(
            f"logit_bias: {len(bias or {})} entries, over the limit of {MAX_LOGIT_BIAS_ENTRIES}"
        )
    for key, value in (bias or {}).items():
        if not str(key).isdigit():
            raise InvalidRequestError(f"logit_bias: key {key!r} is not a token id")
        out[int(key)] = _number(f"logit_bias[{int(key)}]", value, 0.0, -100, 100)
    return out


def _constraint(body: _Sampling) -> Constraint | None:
    """At most one constraint, from response_format, the guided_* fields or
    structured_outputs; checked (compiled by llguidance) here, naming the field."""
    found: list[tuple[str, Constraint]] = []

    def add(name: str, kind: str, source: Any) -> None:
        if source is None:
            return
        if kind == "json_schema" and not isinstance(source, str):
            source = json.dumps(source)
        found.append((name, Constraint(kind, source)))

    fmt = body.response_format or {}
    kind = fmt.get("type", "text")
    if kind == "json_object":
        add("response_format", "json_schema", {"type": "object"})
    elif kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or spec.get("schema") is None:
            raise InvalidRequestError(
                "response_format.json_schema.schema: required with type 'json_schema', got "
                f"{fmt.get('json_schema')!r}"
            )
        add("response_format.json_schema.schema", "json_schema", spec["schema"])
    elif kind != "text":
        raise InvalidRequestError(
            f"response_format.type: expected 'text', 'json_object' or 'json_schema', got {kind!r}"
        )
    add("guided_json", "json_schema", body.guided_json)
    add("guided_regex", "regex", body.guided_regex)
    add("guided_grammar", "grammar", body.guided_grammar)
    so = body.structured_outputs or {}
    for key, kind in (("json", "json_schema"), ("regex", "regex"), ("grammar", "grammar")):
        add(f"structured_outputs.{key}", kind, so.get(key))
    if so.get("json_object"):
        add("structured_outputs.json_object", "json_schema", {"type": "object"})
    for name, value in (("guided_choice", body.guided_choice), ("structured_outputs.choice",
                        so.get("choice"))):  # fmt: skip
        if value is not None:
            raise InvalidRequestError(f"{name}: not supported by this server (send a regex)")
    if len(found) > 1:
        names = [n for n, _ in found]
        raise InvalidRequestError(f"{names[1]}: only one constraint per request, got {names}")
    if not found:
        return None
    name, c = found[0]
    check_constraint(c, name)
    return c


def _common(body: _Sampling, max_tokens: int | None) -> Sampling:
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
    m = MAX_ABS_PRESENCE_PENALTY
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
        min_p=_number("min_p", body.min_p, 0.0, 0, 1),
        logit_bias=_logit_bias(body.logit_bias),
        presence_penalty=_number("presence_penalty", body.presence_penalty, 0.0, -m, m),
        frequency_penalty=_number("frequency_penalty", body.frequency_penalty, 0.0, -m, m),
        repetition_penalty=_number(
            "repetition_penalty", body.repetition_penalty, 1.0, 0, MAX_REPETITION_PENALTY
        ),
        constraint=_constraint(body),
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
