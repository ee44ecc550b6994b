"""The two completion calls, from request to result: resolve `model`, render the prompt
(`prepare_chat`, `prepare_completion`), sample as asample does (`run`), decode, cut stop
strings, parse tool calls, and shape the (non-streamed) OpenAI response. stream.py shapes
the same result as server-sent events; live.py streams tokens as they are sampled.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from treadle.server.api.openai.render import (
    Decoded,
    TokenText,
    chat_logprobs,
    decode_output,
    encode_prompt,
    legacy_logprobs,
    render_chat,
)
from treadle.server.api.openai.resolve import Target, resolve
from treadle.server.api.openai.sampling import Sampled, check_room, sample
from treadle.server.api.openai.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    Sampling,
    check_chat,
    check_completion,
    prompts_of,
)
from treadle.server.api.openai.serving import OpenAIServing
from treadle.server.api.openai.tools import ParsedOutput, parse_tool_calls
from treadle.server.storage.rows import new_id
from treadle.server.tenancy.auth import Tenant


@dataclass
class Choice:
    index: int
    sampled: Sampled
    decoded: Decoded
    parsed: ParsedOutput

    @property
    def finish_reason(self) -> str:
        return "tool_calls" if self.parsed.tool_calls else self.decoded.finish_reason


@dataclass
class Result:
    """Everything a response (streamed or not) is made of."""

    id: str
    created: int
    model: str
    spec: Sampling
    prompts_P: list[list[int]]
    choices: list[Choice]
    token_text: TokenText
    return_token_ids: bool = False

    @property
    def usage(self) -> dict[str, int]:
        prompt = sum(len(p) for p in self.prompts_P)
        completion = sum(len(c.sampled.tokens_T) for c in self.choices)
        # choices run prompt-major, n per prompt: each prompt's cache hit counted once
        cached = sum(c.sampled.prompt_cached for c in self.choices[:: max(self.spec.n, 1)])
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }


@dataclass
class Prepared:
    """A request checked, its `model` resolved and its prompts rendered: ready to sample
    (whole, `run`; or streamed, treadle.server.api.openai.live)."""

    id: str
    created: int
    model: str
    spec: Sampling
    target: Target
    tok: Any
    prompts_P: list[list[int]]
    max_tokens_P: list[int]
    parse_tools: bool = False
    return_token_ids: bool = False

    def choices(self, p: int, sampled: list[Sampled]) -> list[Choice]:
        """Prompt p's choices (numbered prompt-major: p * n + j), decoded, stop strings cut
        and tool calls parsed."""
        out = []
        for j, s in enumerate(sampled):
            decoded = decode_output(self.tok, s.tokens_T, self.spec.stop, s.stop_reason)
            text = decoded.text
            parsed = parse_tool_calls(text) if self.parse_tools else ParsedOutput(text)
            out.append(Choice(p * self.spec.n + j, s, decoded, parsed))
        return out

    def result(self, sampled_P: list[list[Sampled]]) -> Result:
        choices = [c for p, sampled in enumerate(sampled_P) for c in self.choices(p, sampled)]
        return Result(
            self.id,
            self.created,
            self.model,
            self.spec,
            self.prompts_P,
            choices,
            TokenText(self.tok),
            self.return_token_ids,
        )


async def prepare_chat(
    serving: OpenAIServing,
    tenant: Tenant,
    body: ChatCompletionRequest,
    key: bytes | None = None,
) -> Prepared:
    spec = check_chat(body)
    state = serving.state
    target = await resolve(state, serving.checkpoints, tenant.tenant_id, body.model, key=key)
    tok = await serving.tokenizers.get(target.base_model)
    prompt_T = render_chat(tok, body.model, body.messages, body.tools)
    max_tokens = check_room(state, target, prompt_T, spec, "messages")
    return Prepared(
        f"chatcmpl-{new_id()}",
        int(time.time()),
        body.model,
        spec,
        target,
        tok,
        [prompt_T],
        [max_tokens],
        parse_tools=bool(body.tools) and body.tool_choice != "none",
        return_token_ids=bool(body.return_token_ids),
    )


async def prepare_completion(
    serving: OpenAIServing,
    tenant: Tenant,
    body: CompletionRequest,
    key: bytes | None = None,
) -> Prepared:
    spec = check_completion(body)
    prompts = prompts_of(body)
    state = serving.state
    target = await resolve(state, serving.checkpoints, tenant.tenant_id, body.model, key=key)
    tok = await serving.tokenizers.get(target.base_model)
    fields = ["prompt"] if len(prompts) == 1 else [f"prompt[{i}]" for i in range(len(prompts))]
    prompts_P = [encode_prompt(tok, p, f) for p, f in zip(prompts, fields, strict=True)]
    rooms = [check_room(state, target, p, spec, f) for p, f in zip(prompts_P, fields, strict=True)]
    return Prepared(
        f"cmpl-{new_id()}",
        int(time.time()),
        body.model,
        spec,
        target,
        tok,
        prompts_P,
        rooms,
        return_token_ids=bool(body.return_token_ids),
    )


async def run(serving: OpenAIServing, tenant: Tenant, prep: Prepared) -> Result:
    """Sample every prompt to the end (in parallel) and shape the result."""
    per_prompt = await asyncio.gather(
        *(
            sample(serving.state, tenant, prep.target, p, prep.spec, m)
            for p, m in zip(prep.prompts_P, prep.max_tokens_P, strict=True)
        )
    )
    return prep.result(list(per_prompt))


def chat_response(r: Result) -> dict[str, Any]:
    choices = []
    for c in r.choices:
        message: dict[str, Any] = {"role": "assistant", "content": c.parsed.content}
        if c.parsed.tool_calls:
            message["tool_calls"] = c.parsed.tool_calls
        s = c.sampled
        logprobs = None
        if r.spec.logprobs:
            logprobs = {"content": chat_logprobs(r.token_text, s.tokens_T, s.logprobs_T, s.top_TK)}
        choice = {
            "index": c.index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": c.finish_reason,
        }
        if r.return_token_ids:
            choice["token_ids"] = s.tokens_T
        if (r.spec.logprobs or r.return_token_ids) and s.sampling_logprobs_T is not None:
            choice["sampling_logprobs"] = s.sampling_logprobs_T  # docs/sampling.md
        choices.append(choice)
    out = {
        "id": r.id,
        "object": "chat.completion",
        "created": r.created,
        "model": r.model,
        "choices": choices,
        "usage": r.usage,
        "system_fingerprint": None,
    }
    if r.return_token_ids:
        out["prompt_token_ids"] = r.prompts_P[0]
    return out


def completion_response(r: Result) -> dict[str, Any]:
    choices = []
    for c in r.choices:
        s = c.sampled
        logprobs = None
        if r.spec.logprobs:
            tops = s.top_TK if r.spec.top_logprobs > 0 else None
            logprobs = legacy_logprobs(
                r.token_text, s.tokens_T, s.logprobs_T, tops, c.decoded.pieces_T
            )
        choice = {
            "index": c.index,
            "text": c.decoded.text,
            "logprobs": logprobs,
            "finish_reason": c.finish_reason,
        }
        if r.return_token_ids:
            choice["token_ids"] = s.tokens_T
            choice["prompt_token_ids"] = r.prompts_P[c.index // r.spec.n]
        if (r.spec.logprobs or r.return_token_ids) and s.sampling_logprobs_T is not None:
            choice["sampling_logprobs"] = s.sampling_logprobs_T  # docs/sampling.md
        choices.append(choice)
    return {
        "id": r.id,
        "object": "text_completion",
        "created": r.created,
        "model": r.model,
        "choices": choices,
        "usage": r.usage,
        "system_fingerprint": None,
    }
