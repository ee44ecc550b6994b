"""Real streaming on /v1 against a `treadle serve` process (its engine in a worker process),
through the official `openai` client: chunks arrive while the answer is being sampled, and
the stream adds up to the non-streamed answer for the same seed.

    .venv/bin/python -m pytest -q tests/server/api/test_openai_streaming.py
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

openai = pytest.importorskip("openai")

TINY = "treadle/tiny-llama"
API_KEY = "tml-treadle-tests"
WAIT = 120
CHAT = [{"role": "user", "content": "Tell me a short fact."}]


@pytest.fixture(scope="module")
def client(treadle_server):
    url = treadle_server.url
    return openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=WAIT)


def long_seed(client, tokens: int) -> int:
    """A seed whose answer runs to max_tokens (the random tiny model rarely says EOS)."""
    for seed in range(20):
        r = client.completions.create(model=TINY, prompt="Hello", max_tokens=tokens, seed=seed)
        if r.choices[0].finish_reason == "length":
            return seed
    raise AssertionError("no seed ran to max_tokens")


def test_chunks_arrive_while_the_answer_is_sampled(client):
    tokens = 384
    seed = long_seed(client, tokens)
    t0 = time.perf_counter()
    times, texts = [], []
    stream = client.completions.create(
        model=TINY, prompt="Hello", max_tokens=tokens, seed=seed, stream=True
    )
    for chunk in stream:
        times.append(time.perf_counter() - t0)
        texts.append(chunk.choices[0].text)
        if chunk.choices[0].finish_reason is not None:
            final_at = times[-1]
    first_at = times[0]
    # a replayed answer arrives in one burst once complete; here the first chunk leaves after
    # the prefill and one decode step, and the chunks are spread over the generation
    before_final = sum(1 for t in times if t < final_at)
    assert before_final >= tokens // 4, before_final
    assert first_at < 0.5 * final_at, (first_at, final_at)
    spread = [t for t in times if t < final_at]
    assert spread[len(spread) // 2] - first_at > 0.2 * (final_at - first_at)
    plain = client.completions.create(model=TINY, prompt="Hello", max_tokens=tokens, seed=seed)
    assert "".join(texts) == plain.choices[0].text


def _chat_stream(client, **kw):
    text, finish, lps, usage, roles = {}, {}, {}, None, 0
    for ch in client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}
    ):
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            roles += c.delta.role == "assistant"
            text[c.index] = text.get(c.index, "") + (c.delta.content or "")
            lps.setdefault(c.index, []).extend(
                e.logprob for e in (c.logprobs.content if c.logprobs else [])
            )
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    return text, finish, lps, usage, roles


@pytest.mark.parametrize("stop", [None, ["e"], ["th", "a"]])
def test_a_streamed_chat_adds_up_to_the_plain_answer(client, stop):
    kw = dict(model=TINY, messages=CHAT, max_tokens=40, seed=3, n=3, logprobs=True, stop=stop)
    plain = client.chat.completions.create(**kw)
    text, finish, lps, usage, roles = _chat_stream(client, **kw)
    assert roles == 3
    for c in plain.choices:
        assert text[c.index] == c.message.content
        assert finish[c.index] == c.finish_reason
        np.testing.assert_allclose(lps[c.index], [e.logprob for e in c.logprobs.content], atol=1e-5)
    assert usage.completion_tokens == plain.usage.completion_tokens
    assert usage.prompt_tokens == plain.usage.prompt_tokens


def test_streamed_completions_of_several_prompts(client):
    kw = dict(model=TINY, prompt=["Question: Tom has", "Hi"], max_tokens=30, seed=8, n=2)
    plain = client.completions.create(**kw)
    got: dict[int, str] = {}
    finish: dict[int, str] = {}
    for ch in client.completions.create(**kw, stream=True):
        for c in ch.choices:
            got[c.index] = got.get(c.index, "") + c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert [got[c.index] for c in plain.choices] == [c.text for c in plain.choices]
    assert [finish[c.index] for c in plain.choices] == [c.finish_reason for c in plain.choices]


def test_errors_before_the_first_token_keep_their_status(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no/such", messages=CHAT, stream=True)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=TINY, prompt="Hi", max_tokens=10**6, stream=True)


def test_a_stream_survives_its_worker_being_killed(start_server):
    """The worker dies mid-answer: the API resends the op to the new worker, which samples
    it again from the start; the stream pauses, repeats nothing and ends as the plain
    answer does."""
    server = start_server(process=True)
    client = openai.OpenAI(
        base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=WAIT
    )
    tokens = 384
    seed = long_seed(client, tokens)
    plain = client.completions.create(model=TINY, prompt="Hello", max_tokens=tokens, seed=seed)
    texts, times, killed = [], [], False
    stream = client.completions.create(
        model=TINY, prompt="Hello", max_tokens=tokens, seed=seed, stream=True
    )
    for i, chunk in enumerate(stream):
        texts.append(chunk.choices[0].text)
        times.append(time.perf_counter())
        if i == 10:
            for pid in server.children():
                os.kill(pid, signal.SIGKILL)
            killed = True
    assert killed and "exited" in server.log()
    # the pause of a new worker loading the model came after chunk 10, mid-answer
    gaps = np.diff(times)
    assert int(np.argmax(gaps)) >= 10 and len(times) - 11 > tokens // 4
    assert "".join(texts) == plain.choices[0].text
