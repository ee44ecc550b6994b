"""Tool calls in model output, in the Hermes / Qwen convention the chat templates use:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`parse_tool_calls` turns them into OpenAI `tool_calls`; the text around them stays content.
A block that is not a JSON object with a "name" is left in the content untouched.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


@dataclass
class ParsedOutput:
    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


def template_supports_tools(chat_template: Any) -> bool:
    """Whether a chat template renders `tools` (a dict of named templates: any of them)."""
    if isinstance(chat_template, dict):
        return any(template_supports_tools(t) for t in chat_template.values())
    return isinstance(chat_template, str) and "tools" in chat_template


def parse_tool_calls(text: str) -> ParsedOutput:
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    last = 0
    for m in TOOL_CALL.finditer(text):
        call = _call_of(m.group(1))
        if call is None:
            continue
        kept.append(text[last : m.start()])
        last = m.end()
        calls.append(call)
    if not calls:
        return ParsedOutput(text)
    kept.append(text[last:])
    content = "".join(kept).strip()
    return ParsedOutput(content or None, calls)


def _call_of(block: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {
        "id": f"call_{secrets.token_hex(12)}",
        "type": "function",
        "function": {
            "name": obj["name"],
            "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False),
        },
    }


def template_tool_calls(tool_calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An assistant message's OpenAI tool_calls as chat templates read them: arguments as a
    mapping (templates apply `tojson`), name and arguments under `function`."""
    out = []
    for call in tool_calls:
        fn = dict(call.get("function") or {})
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                fn["arguments"] = json.loads(args)
            except json.JSONDecodeError:
                pass  # a template that prints strings as they are still gets the text
        out.append({"id": call.get("id"), "type": "function", "function": fn})
    return out
