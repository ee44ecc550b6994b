"""A sampled answer as an Anthropic message: content blocks (text, then tool_use blocks for
the tool calls parsed from the output), stop_reason and usage.

    stop_reason   end_turn       the model ended its turn (an end-of-sequence token)
                  stop_sequence  one of stop_sequences (named in stop_sequence; cut off)
                  max_tokens     max_tokens reached
                  tool_use       the answer calls a tool
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from treadle.server.api.openai.completions import Choice, Prepared


def stop_of(prep: Prepared, choice: Choice) -> tuple[str, str | None]:
    """→ (stop_reason, stop_sequence)."""
    if choice.parsed.tool_calls:
        return "tool_use", None
    if choice.decoded.finish_reason == "length":
        return "max_tokens", None
    if prep.spec.stop:
        text = prep.tok.decode(choice.sampled.tokens_T, skip_special_tokens=True)
        found = [(text.find(s), s) for s in prep.spec.stop if s in text]
        if found:
            return "stop_sequence", min(found)[1]
    return "end_turn", None


def content_of(choice: Choice) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if choice.parsed.content:
        blocks.append({"type": "text", "text": choice.parsed.content})
    for call in choice.parsed.tool_calls:
        fn = call["function"]
        try:
            args = json.loads(fn["arguments"])
        except json.JSONDecodeError:
            args = {"arguments": fn["arguments"]}
        if not isinstance(args, dict):  # Anthropic's input is always an object
            args = {"arguments": args}
        blocks.append({"type": "tool_use", "id": tool_use_id(), "name": fn["name"], "input": args})
    return blocks


def tool_use_id() -> str:
    return f"toolu_{secrets.token_hex(12)}"


def message_id() -> str:
    return f"msg_{secrets.token_hex(12)}"


def message(
    msg_id: str, prep: Prepared, choice: Choice, content: list[dict[str, Any]]
) -> dict[str, Any]:
    reason, sequence = stop_of(prep, choice)
    return {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "model": prep.model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(len(prep.prompts_P[0]), len(choice.sampled.tokens_T)),
    }


def usage(input_tokens: int, output_tokens: int) -> dict[str, int]:
    return {
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }
