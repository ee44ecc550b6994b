"""Text in and out: chat messages rendered with the model's own chat template, prompts
encoded, sampled tokens decoded into text pieces (one per token, for streaming), stop
strings cut off, and logprob entries in OpenAI's two formats.

The tokenizer is loaded from the served model's folder, once per model, apart from the
engine's own copy (a fast tokenizer must not be used by two threads at once).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from functools import cache
from typing import Any

from treadle.errors import InvalidRequestError
from treadle.server.api.openai.schemas import ChatMessage
from treadle.server.api.openai.tools import template_supports_tools, template_tool_calls

ROLES = ("system", "developer", "user", "assistant", "tool")


class Tokenizers:
    """The tokenizer of each served base model, loaded on first use."""

    def __init__(self, folders: dict[str, str]):
        self.folders = folders
        self._loaded: dict[str, Any] = {}
        self._lock = asyncio.Lock()

    async def get(self, base_model: str) -> Any:
        tok = self._loaded.get(base_model)
        if tok is None:
            async with self._lock:
                tok = self._loaded.get(base_model)
                if tok is None:
                    tok = await asyncio.to_thread(_load, self.folders[base_model])
                    self._loaded[base_model] = tok
        return tok


def _load(folder: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


# ---- prompts ------------------------------------------------------------------------------


def _text_of(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for j, part in enumerate(content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise InvalidRequestError(
                f"{where}[{j}]: only text parts are supported, got type {part.get('type')!r}"
            )
        parts.append(part["text"])
    return "".join(parts)


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """OpenAI messages as chat templates read them (plain-text content, developer as system,
    tool call arguments as mappings)."""
    out = []
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise InvalidRequestError(
                f"messages[{i}].role: expected one of {list(ROLES)}, got {m.role!r}"
            )
        msg: dict[str, Any] = {
            "role": "system" if m.role == "developer" else m.role,
            "content": _text_of(m.content, f"messages[{i}].content"),
        }
        if m.tool_calls:
            msg["tool_calls"] = template_tool_calls(m.tool_calls)
        for key in ("name", "tool_call_id"):
            if getattr(m, key) is not None:
                msg[key] = getattr(m, key)
        out.append(msg)
    return out


def render_chat(
    tok: Any, model: str, messages: list[ChatMessage], tools: list[dict] | None
) -> list[int]:
    """The prompt tokens of a chat: the template's text with the generation prompt."""
    if not tok.chat_template:
        raise InvalidRequestError(
            f"model: {model!r} has no chat template; use /v1/completions with a text prompt"
        )
    kwargs: dict[str, Any] = {}
    if tools:
        if not template_supports_tools(tok.chat_template):
            raise InvalidRequestError(
                f"tools: the chat template of {model!r} does not render tools; omit them"
            )
        kwargs["tools"] = tools
    msgs = template_messages(messages)
    try:
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kwargs)
    except Exception as e:  # jinja's TemplateError, or raise_exception() inside the template
        raise InvalidRequestError(
            f"messages: the chat template of {model!r} rejected them: {type(e).__name__}: {e}"
        ) from e
    return tok.encode(text, add_special_tokens=False)


def encode_prompt(tok: Any, prompt: str | list[int], where: str) -> list[int]:
    """A completion prompt: text (with the tokenizer's special tokens, e.g. BOS) or ids."""
    if isinstance(prompt, str):
        return tok.encode(prompt, add_special_tokens=True)
    vocab = len(tok)
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise InvalidRequestError(
            f"{where}: token ids outside the vocabulary [0, {vocab}): {bad[:5]}"
        )
    return list(prompt)


# ---- outputs ------------------------------------------------------------------------------


@dataclass
class Decoded:
    """One sampled sequence as text: pieces_T[i] is the text token i adds ("" while a
    multi-byte character is incomplete, and after a stop string)."""

    text: str
    pieces_T: list[str]
    finish_reason: str


def decode_output(tok: Any, tokens_T: list[int], stop: list[str], stop_reason: str) -> Decoded:
    pieces = _pieces(tok, tokens_T)
    text = "".join(pieces)
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
    if cut < 0:
        return Decoded(text, pieces, "stop" if stop_reason == "stop" else "length")
    # OpenAI leaves the stop string out of the text
    kept, used = [], 0
    for p in pieces:
        take = p[: max(0, cut - used)]
        kept.append(take)
        used += len(take)
    return Decoded(text[:cut], kept, "stop")


def _pieces(tok: Any, tokens_T: list[int]) -> list[str]:
    """Incremental detokenization over a short window: the difference between decoding the
    window with and without the new tokens is exactly their text."""
    pieces: list[str] = []
    start = 0  # first token whose text is not out yet
    for i in range(len(tokens_T)):
        s = max(0, start - 4)
        before = tok.decode(tokens_T[s:start], skip_special_tokens=True)
        now = tok.decode(tokens_T[s : i + 1], skip_special_tokens=True)
        if now.endswith("\ufffd") and i + 1 < len(tokens_T):
            pieces.append("")  # a character split across tokens: wait for its last byte
            continue
        pieces.append(now[len(before) :] if now.startswith(before) else now)
        start = i + 1
    return pieces


class LiveText:
    """One choice's text while its tokens arrive: `push` returns the text that is final
    now. A character split across tokens waits for its last byte (as `_pieces` does), and
    text that may be the start of a stop string waits until it cannot be (OpenAI leaves the
    stop string out), so everything sent is a prefix of what `decode_output` makes of the
    whole answer; `finish` sends the rest of that.
    """

    def __init__(self, tok: Any, stop: list[str]):
        self.tok, self.stop = tok, stop
        self.tokens: list[int] = []
        self.text = ""  # the pieces of the tokens so far, joined
        self.sent = 0  # how much of it went out
        self._start = 0  # first token whose text is not out yet

    def push(self, token: int) -> str:
        self.tokens.append(token)
        i, s = len(self.tokens) - 1, max(0, self._start - 4)
        before = self.tok.decode(self.tokens[s : self._start], skip_special_tokens=True)
        now = self.tok.decode(self.tokens[s : i + 1], skip_special_tokens=True)
        if not now.endswith("\ufffd"):
            self.text += now[len(before) :] if now.startswith(before) else now
            self._start = i + 1
        end = self._final_end()
        out = self.text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out

    def _final_end(self) -> int:
        """How much of the text no stop string can cut any more: up to the first stop
        string in it, and short of a tail that a stop string may start with."""
        end = len(self.text)
        for stop in self.stop:
            found = self.text.find(stop)
            if found >= 0:
                end = min(end, found)
            for k in range(min(len(stop) - 1, len(self.text)), 0, -1):
                if self.text.endswith(stop[:k]):
                    end = min(end, len(self.text) - k)
                    break
        return end

    def finish(self, final_text: str) -> str:
        """The rest of the whole answer's text (empty if what went out is not its start,
        which a run again of a request without a seed could cause)."""
        sent = self.text[: self.sent]
        self.sent = len(final_text)
        return final_text[len(sent) :] if final_text.startswith(sent) else ""


@cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted (what ByteLevel BPE tokens are spelled in)."""
    bs = list(range(ord("!"), ord("~") + 1))
    bs += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


class TokenText:
    """Each token's text and bytes, as OpenAI's logprobs report them."""

    def __init__(self, tok: Any):
        self.tok = tok
        decoder = getattr(getattr(tok, "backend_tokenizer", None), "decoder", None)
        self.byte_level = "ByteLevel" in type(decoder).__name__ or "ByteLevel" in repr(decoder)

    def bytes_of(self, token_id: int) -> list[int]:
        if self.byte_level:
            spelled = self.tok.convert_ids_to_tokens(token_id)
            table = _byte_decoder()
            if isinstance(spelled, str) and all(c in table for c in spelled):
                return [table[c] for c in spelled]
        return list(self.text_of(token_id).encode("utf-8"))

    def text_of(self, token_id: int) -> str:
        return self.tok.decode([token_id], skip_special_tokens=False)

    def entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        return {
            "token": self.text_of(token_id),
            "logprob": logprob,
            "bytes": self.bytes_of(token_id),
        }


def chat_logprobs(
    tt: TokenText,
    tokens_T: list[int],
    logprobs_T: list[float],
    top_TK: list[list[tuple[int, float]]] | None,
) -> list[dict[str, Any]]:
    """`choices[i].logprobs.content` of a chat completion."""
    out = []
    for i, (t, lp) in enumerate(zip(tokens_T, logprobs_T, strict=True)):
        e = tt.entry(t, lp)
        e["top_logprobs"] = [tt.entry(k, v) for k, v in top_TK[i]] if top_TK else []
        out.append(e)
    return out


def legacy_logprobs(
    tt: TokenText,
    tokens_T: list[int],
    logprobs_T: list[float],
    top_TK: list[list[tuple[int, float]]] | None,
    pieces_T: list[str],
    offset: int = 0,
) -> dict[str, Any]:
    """`choices[i].logprobs` of a /v1/completions response (tokens, token_logprobs,
    top_logprobs, text_offset)."""
    offsets, at = [], offset
    for p in pieces_T:
        offsets.append(at)
        at += len(p)
    tops = None
    if top_TK is not None:
        tops = [{tt.text_of(k): v for k, v in row} for row in top_TK]
    return {
        "tokens": [tt.text_of(t) for t in tokens_T],
        "token_logprobs": list(logprobs_T),
        "top_logprobs": tops,
        "text_offset": offsets,
    }
