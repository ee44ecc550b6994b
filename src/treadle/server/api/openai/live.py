"""Streams that send each token as it is sampled: /v1 answers with stream=true.

Each prompt's sample op is filed with `stream` set (sampling.file_streamed); the engine
loop reports its tokens after every decode step (Progress, across the worker boundary too),
the futures board hands them to this stream, and they go out at once: the first chunk
leaves after the prefill and one decode step. Text goes out as it becomes final
(render.LiveText: never half a character, never the start of a stop string that may still
complete). When a prompt's op ends, its recorded result finishes its choices: the text and
logprobs not sent yet, then finish_reason; after the last one, the usage chunk and [DONE].

The stream starts only once its first event is in (a token, or an op's end), so an error
before the first token (a missing adapter, a quota) is an ordinary JSON error response with
its status; an error after it goes out as an `error` event, which OpenAI's clients raise.

A client that goes away mid-stream cancels its ops: they leave the decode batch at the next
decode step (treadle.server.core.cancellation), metered for what they sampled.

Tokens carry their position: when an op runs again (its worker restarted while this stream
was open) nothing already sent is sent twice, and since a streamed op always has a seed,
the run again samples the same tokens.

Chunks that need the whole answer (top_logprobs, which tokens do not carry; tool calls,
parsed from the whole text; legacy completion logprobs with their text offsets) make the
request sample whole and be replayed (stream.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

from treadle.errors import TreadleError
from treadle.protocol.ops import Progress
from treadle.server.api.openai.completions import Prepared
from treadle.server.api.openai.errors import error_body
from treadle.server.api.openai.render import LiveText, TokenText, chat_logprobs
from treadle.server.api.openai.sampling import Sampled, file_streamed, result_of, sampled_of
from treadle.server.api.openai.stream import DONE, HEADERS, frame, sse, usage_chunk
from treadle.server.core.cancellation import cancel_ops
from treadle.server.core.state import ServerState
from treadle.server.tenancy.auth import Tenant

log = logging.getLogger("treadle.openai")

# (prompt index, its op's Progress, or None once the op has ended)
Event = tuple[int, Progress | None]


def streams_live(prep: Prepared, chat: bool) -> bool:
    """Whether the chunks of this request can go out as its tokens are sampled."""
    spec = prep.spec
    return spec.top_logprobs == 0 and not prep.parse_tools and (chat or not spec.logprobs)


async def live_response(
    state: ServerState, tenant: Tenant, prep: Prepared, chat: bool
) -> StreamingResponse:
    """File the prompts' ops and answer with their stream once its first event is in."""
    rids = await asyncio.gather(
        *(
            file_streamed(state, tenant, prep.target, p, prep.spec, m)
            for p, m in zip(prep.prompts_P, prep.max_tokens_P, strict=True)
        )
    )
    stream = _LiveStream(state, prep, list(rids), chat)
    try:
        first = await stream.next_event()
        if first[1] is None:  # an op over before its first token: its error is a plain reply
            await stream.end_of(first[0])
    except BaseException:
        stream.close()
        raise
    return StreamingResponse(stream.events(first), media_type="text/event-stream", headers=HEADERS)


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("could not cancel the ops of a closed stream: %s", task.exception())


class _LiveStream:
    def __init__(self, state: ServerState, prep: Prepared, rids: list[str], chat: bool):
        self.state, self.prep, self.rids, self.chat = state, prep, rids, chat
        self.obj = "chat.completion.chunk" if chat else "text_completion"
        self.token_text = TokenText(prep.tok)
        n = prep.spec.n
        self.texts = [LiveText(prep.tok, prep.spec.stop) for _ in range(len(rids) * n)]
        self.logprobs_sent = [0] * len(self.texts)
        self.sampled: dict[int, list[Sampled]] = {}  # by prompt, once its op has ended
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.tasks = [asyncio.create_task(self._follow(p, rid)) for p, rid in enumerate(rids)]

    async def _follow(self, p: int, rid: str) -> None:
        try:
            async for item in self.state.futures.updates(rid):
                self.queue.put_nowait((p, item))
        finally:
            self.queue.put_nowait((p, None))

    async def next_event(self) -> Event:
        return await self.queue.get()

    async def end_of(self, p: int) -> list[Sampled]:
        """Prompt p's choices once its op has ended (its error raised as its own class)."""
        if p not in self.sampled:
            self.sampled[p] = sampled_of(await result_of(self.state, self.rids[p]))
        return self.sampled[p]

    def close(self) -> None:
        """The stream is over: finished, failed, or its client went away. Ops still
        generating then are cancelled (between two decode steps: their slots free)."""
        for task in self.tasks:
            task.cancel()
        running = [rid for p, rid in enumerate(self.rids) if p not in self.sampled]
        if running:
            engine = self.state.engines.get(self.prep.target.base_model)
            name = engine.name if engine is not None else None
            task = asyncio.get_running_loop().create_task(cancel_ops(self.state, running, name))
            task.add_done_callback(_log_failure)

    async def events(self, first: Event) -> AsyncIterator[str]:
        try:
            if self.chat:
                for i in range(len(self.texts)):
                    yield sse(self._chunk(i, {"role": "assistant", "content": ""}))
            event, ended = first, 0
            while True:
                p, item = event
                if item is not None:
                    for chunk in self._tokens(p, item):
                        yield sse(chunk)
                else:
                    try:
                        sampled = await self.end_of(p)
                    except TreadleError as e:  # after the first token: in the stream
                        yield sse(error_body(str(e), e.status))
                        break
                    for chunk in self._finish(p, sampled):
                        yield sse(chunk)
                    ended += 1
                    if ended == len(self.rids):
                        if self.prep.spec.include_usage:
                            sampled_P = [self.sampled[q] for q in range(len(self.rids))]
                            yield sse(usage_chunk(self.prep.result(sampled_P), self.obj))
                        break
                event = await self.next_event()
            yield sse(DONE)
        finally:
            self.close()

    # ---- chunks ----
    def _chunk(
        self, index: int, delta: Any, logprobs: Any = None, finish: str | None = None
    ) -> dict:
        if self.chat:
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": index, "text": delta, "logprobs": None, "finish_reason": finish}
        return {**frame(self.prep, self.obj), "choices": [choice]}

    def _tokens(self, p: int, item: Progress) -> list[dict]:
        """A chunk per new token that adds text (or a logprob entry); a token at a position
        already sent (the op ran again) is skipped."""
        chunks = []
        for j, pos, token, logprob in item.tokens:
            index = p * self.prep.spec.n + j
            live = self.texts[index]
            if pos != len(live.tokens):
                continue
            text = live.push(token)
            lp = None
            if self.chat and self.prep.spec.logprobs:
                lp = {"content": chat_logprobs(self.token_text, [token], [logprob], None)}
                self.logprobs_sent[index] += 1
            if text or lp:
                chunks.append(self._chunk(index, {"content": text} if self.chat else text, lp))
        return chunks

    def _finish(self, p: int, sampled: list[Sampled]) -> list[dict]:
        """The rest of prompt p's choices from its result: text, logprobs, finish_reason."""
        chunks = []
        for c in self.prep.choices(p, sampled):
            rest = self.texts[c.index].finish(c.decoded.text)
            s, sent = c.sampled, self.logprobs_sent[c.index]
            lp = None
            if self.chat and self.prep.spec.logprobs and len(s.tokens_T) > sent:
                rest_lp = chat_logprobs(
                    self.token_text, s.tokens_T[sent:], s.logprobs_T[sent:], None
                )
                lp = {"content": rest_lp}
            if rest or lp:
                chunks.append(self._chunk(c.index, {"content": rest} if self.chat else rest, lp))
            chunks.append(self._chunk(c.index, {} if self.chat else "", None, c.finish_reason))
        return chunks
