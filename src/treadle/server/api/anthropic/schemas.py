"""The body of POST /v1/messages, and its translation into a chat completion request, so
that a Messages call resolves its model, renders its prompt, samples and is metered by the
very code of /v1/chat/completions.

    system                          → a system message
    user: text blocks               → a user message
    user: tool_result blocks        → tool messages (tool_call_id = tool_use_id), before the
                                      user's text, as Anthropic orders them
    assistant: text + tool_use      → an assistant message with tool_calls
    tools [{name, description, input_schema}] → OpenAI function tools; the chat template
                                      renders them (Hermes/Qwen <tool_call> convention)
    stop_sequences, temperature, top_p, top_k, max_tokens → the same sampling fields

Refused with a 400 naming the field: image and document blocks, extended thinking, and a
tool_choice that forces a tool (nothing here can force a model to call one).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict

from treadle.errors import InvalidRequestError
from treadle.server.api.openai.schemas import ChatCompletionRequest, ChatMessage


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # metadata, service_tier, ... are ignored

    model: str
    max_tokens: int
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    thinking: dict[str, Any] | None = None
    seed: int | None = None  # an extension (as /v1's): the same seed, the same tokens


def _text(content: Any, where: str) -> str:
    """The text of a block list (or a plain string) that may only hold text blocks."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if not isinstance(content, list):
        raise InvalidRequestError(f"{where}: expected a string or a list of blocks")
    parts = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise InvalidRequestError(f"{where}[{j}]: only text blocks are supported, got {kind!r}")
        parts.append(str(block.get("text", "")))
    return "".join(parts)


def _blocks(content: Any) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return list(content or [])


def _user(content: Any, where: str) -> list[ChatMessage]:
    tool_msgs, texts = [], []
    for j, block in enumerate(_blocks(content)):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "tool_result":
            tool_id = block.get("tool_use_id")
            if not isinstance(tool_id, str) or not tool_id:
                raise InvalidRequestError(f"{where}[{j}].tool_use_id: required")
            text = _text(block.get("content"), f"{where}[{j}].content")
            tool_msgs.append(ChatMessage(role="tool", tool_call_id=tool_id, content=text))
        else:
            raise InvalidRequestError(
                f"{where}[{j}].type: user blocks may be text or tool_result, got {kind!r}"
            )
    out = tool_msgs
    if texts or not tool_msgs:
        out.append(ChatMessage(role="user", content="".join(texts)))
    return out


def _assistant(content: Any, where: str) -> ChatMessage:
    texts, calls = [], []
    for j, block in enumerate(_blocks(content)):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "tool_use":
            name = block.get("name")
            if not isinstance(name, str) or not name:
                raise InvalidRequestError(f"{where}[{j}].name: required")
            args = block.get("input", {})
            calls.append(
                {
                    "id": str(block.get("id") or f"toolu_{j}"),
                    "type": "function",
                    "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)},
                }
            )
        elif kind in ("thinking", "redacted_thinking"):
            continue  # an earlier turn's thinking is not shown to the model again
        else:
            raise InvalidRequestError(
                f"{where}[{j}].type: assistant blocks may be text or tool_use, got {kind!r}"
            )
    return ChatMessage(role="assistant", content="".join(texts), tool_calls=calls or None)


def _tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for i, tool in enumerate(tools):
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(f"tools[{i}].name: required, got {name!r}")
        if tool.get("type") not in (None, "custom"):
            raise InvalidRequestError(
                f"tools[{i}].type: only client tools (with input_schema) are supported, got "
                f"{tool.get('type')!r}"
            )
        fn: dict[str, Any] = {"name": name}  # in OpenAI's order: templates print it as is
        if tool.get("description"):
            fn["description"] = tool["description"]
        fn["parameters"] = tool.get("input_schema") or {"type": "object"}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: dict[str, Any] | None) -> str | None:
    kind = (choice or {}).get("type", "auto")
    if kind in ("auto", "none"):
        return kind
    raise InvalidRequestError(
        f"tool_choice: only {{'type': 'auto'}} and {{'type': 'none'}} are supported (a model "
        f"cannot be forced to call a tool here), got type {kind!r}"
    )


def to_chat(body: MessagesRequest) -> ChatCompletionRequest:
    """The chat completion request that asks the same of the model."""
    if body.thinking and body.thinking.get("type") != "disabled":
        raise InvalidRequestError("thinking: extended thinking is not supported (omit it)")
    if body.max_tokens < 1:
        raise InvalidRequestError(f"max_tokens: expected >= 1, got {body.max_tokens}")
    if body.temperature is not None and not 0 <= body.temperature <= 1:
        raise InvalidRequestError(f"temperature: expected 0..1, got {body.temperature}")
    if not body.messages:
        raise InvalidRequestError("messages: expected at least one message, got none")
    if body.messages[-1].get("role") == "assistant":
        raise InvalidRequestError(
            f"messages[{len(body.messages) - 1}].role: the last message must be the user's "
            "(continuing a prefilled assistant turn is not supported)"
        )
    messages: list[ChatMessage] = []
    if body.system:
        messages.append(ChatMessage(role="system", content=_text(body.system, "system")))
    for i, m in enumerate(body.messages):
        where = f"messages[{i}].content"
        role = m.get("role") if isinstance(m, dict) else None
        if role == "user":
            messages += _user(m.get("content"), where)
        elif role == "assistant":
            messages.append(_assistant(m.get("content"), where))
        else:
            raise InvalidRequestError(
                f"messages[{i}].role: expected 'user' or 'assistant', got {role!r}"
            )
    return ChatCompletionRequest(
        model=body.model,
        messages=messages,
        max_tokens=body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        stop=body.stop_sequences or None,
        seed=body.seed,
        tools=_tools(body.tools) if body.tools else None,
        tool_choice=_tool_choice(body.tool_choice) if body.tools else None,
    )
