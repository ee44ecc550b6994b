"""The OpenAI-compatible routes against a real `treadle serve` process, through the official
`openai` client (sync and async, streamed and not).

Each answer is checked against an independent computation: the tokens and logprobs that
`SamplingClient.sample` returns for the same rendered prompt and seed, the chat template
rendered here with transformers, and top logprobs against plain transformers.

    .venv/bin/python -m pytest -q tests/server/api/test_openai_api.py
"""

from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np
import pytest

from treadle import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient

openai = pytest.importorskip("openai")
torch = pytest.importorskip("torch")

TINY = "treadle/tiny-llama"  # the name tests/conftest.py serves the tiny model under
API_KEY = "tml-treadle-tests"
WAIT = 120  # seconds any single result may take on a busy 2-core machine
ATOL = 2e-3  # logprobs of the same weights computed in different batch shapes
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]
IDS = {"return_token_ids": True}  # vLLM's extension: token ids in the response


@pytest.fixture(scope="module")
def url(treadle_server) -> str:
    return treadle_server.url


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=WAIT)


@pytest.fixture(scope="module")
def svc(url):
    with ServiceClient(base_url=url, api_key=API_KEY) as svc:
        yield svc


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def base_sampler(svc):
    return svc.create_sampling_client(base_model=TINY)


def chat_ids(tok, messages, **kw) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)
    return tok.encode(text, add_special_tokens=False)


def extra(obj, key):
    return (obj.model_extra or {})[key]


def sdk_sample(sampler, prompt, n, max_tokens, seed, **kw):
    params = SamplingParams(max_tokens=max_tokens, seed=seed, **kw)
    return sampler.sample(prompt, num_samples=n, sampling_params=params).result(WAIT).sequences


def assert_same_choices(choices, seqs, tok):
    """OpenAI choices against the sampler's sequences: tokens, logprobs, text."""
    assert len(choices) == len(seqs)
    for choice, seq in zip(choices, seqs, strict=True):
        assert extra(choice, "token_ids") == seq.tokens
        got = [e.logprob for e in choice.logprobs.content]
        np.testing.assert_allclose(got, seq.logprobs, atol=1e-5)
        assert [e.token for e in choice.logprobs.content] == [tok.decode([t]) for t in seq.tokens]
        assert choice.message.content == tok.decode(seq.tokens, skip_special_tokens=True)
        assert choice.finish_reason == seq.stop_reason


def test_chat_returns_what_the_sampling_client_samples_for_the_same_seed(client, tok, base_sampler):
    prompt = chat_ids(tok, CHAT)
    seqs = sdk_sample(base_sampler, prompt, n=3, max_tokens=10, seed=11)
    r = client.chat.completions.create(
        model=TINY, messages=CHAT, max_tokens=10, seed=11, n=3, logprobs=True, extra_body=IDS
    )
    assert extra(r, "prompt_token_ids") == prompt  # rendered with the model's chat template
    assert_same_choices(r.choices, seqs, tok)
    assert len({tuple(s.tokens) for s in seqs}) > 1, "n=3 gave three identical samples"
    assert r.object == "chat.completion" and r.model == TINY
    assert r.usage.prompt_tokens == len(prompt)
    assert r.usage.completion_tokens == sum(len(s.tokens) for s in seqs)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def _collect_chat_stream(chunks) -> tuple[dict, dict, dict, object]:
    text, finish, lps, usage = {}, {}, {}, None
    for ch in chunks:
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            text[c.index] = text.get(c.index, "") + (c.delta.content or "")
            lps.setdefault(c.index, []).extend(
                e.logprob for e in (c.logprobs.content if c.logprobs else [])
            )
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    return text, finish, lps, usage


def test_streams_sync_and_async_replay_the_same_answer(client, url):
    kw = dict(model=TINY, messages=CHAT, max_tokens=8, seed=5, n=2, logprobs=True)
    plain = client.chat.completions.create(**kw)
    stream = client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}
    )
    text, finish, lps, usage = _collect_chat_stream(stream)
    for c in plain.choices:
        assert text[c.index] == c.message.content and finish[c.index] == c.finish_reason
        assert lps[c.index] == [e.logprob for e in c.logprobs.content]
    assert usage.completion_tokens == plain.usage.completion_tokens

    async def run():
        aclient = openai.AsyncOpenAI(
            base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=WAIT
        )
        async with aclient:
            a_plain = await aclient.chat.completions.create(**kw)
            a_stream = await aclient.chat.completions.create(**kw, stream=True)
            chunks = [ch async for ch in a_stream]
            ckw = dict(model=TINY, prompt="Question: Tom has 3 apples", max_tokens=6, seed=2)
            c_plain = await aclient.completions.create(**ckw)
            c_stream = await aclient.completions.create(**ckw, stream=True)
            c_text = "".join([c.choices[0].text async for c in c_stream if c.choices])
        return a_plain, chunks, c_plain, c_text

    a_plain, chunks, c_plain, c_text = asyncio.run(run())
    a_text, _, _, _ = _collect_chat_stream(chunks)
    assert [c.message.content for c in a_plain.choices] == [
        c.message.content for c in plain.choices
    ]
    assert [a_text[i] for i in range(2)] == [c.message.content for c in plain.choices]
    assert c_text == c_plain.choices[0].text
    # the wire format itself: server-sent events, ending with [DONE]
    with httpx.stream("POST", f"{url}/v1/completions", json={**kw_text(), "stream": True}) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] in ("stop", "length")


def kw_text() -> dict:
    return {"model": TINY, "prompt": "Hello", "max_tokens": 3, "seed": 1}


def test_completion_stop_strings_are_cut_and_legacy_logprobs_match(client, tok, base_sampler):
    prompt_text = "Question: Tom has 3 apples"
    prompt = tok.encode(prompt_text)
    for seed in range(20):  # a sample whose text is plain (no special token) and long enough
        (seq,) = sdk_sample(base_sampler, prompt, n=1, max_tokens=12, seed=seed)
        text = tok.decode(seq.tokens, skip_special_tokens=False)
        if len(text) >= 8 and text == tok.decode(seq.tokens, skip_special_tokens=True):
            break
    stop = text[4:6]
    cut = text.find(stop)
    # the sampler stops at the token that completes the stop string
    k = next(i for i in range(1, len(seq.tokens) + 1) if stop in tok.decode(seq.tokens[:i]))
    r = client.completions.create(
        model=TINY, prompt=prompt_text, max_tokens=12, seed=seed, stop=[stop], logprobs=3,
        extra_body=IDS,
    )  # fmt: skip
    (choice,) = r.choices
    assert choice.text == text[:cut] and choice.finish_reason == "stop"
    assert extra(choice, "token_ids") == seq.tokens[:k]
    np.testing.assert_allclose(choice.logprobs.token_logprobs, seq.logprobs[:k], atol=1e-5)
    assert all(len(top) <= 3 for top in choice.logprobs.top_logprobs)
    assert len(choice.logprobs.tokens) == k == r.usage.completion_tokens
    # by token ids, and several prompts at once: choices are numbered prompt-major
    r2 = client.completions.create(model=TINY, prompt=[prompt, prompt], max_tokens=12, seed=seed)
    assert [c.index for c in r2.choices] == [0, 1]
    assert (
        r2.choices[0].text == r2.choices[1].text == tok.decode(seq.tokens, skip_special_tokens=True)
    )
    assert r2.choices[0].finish_reason == seq.stop_reason


def test_top_logprobs_are_the_model_distribution(client, tok, plain_model):
    r = client.chat.completions.create(
        model=TINY, messages=CHAT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=5,
        extra_body=IDS,
    )  # fmt: skip
    ids = extra(r, "prompt_token_ids") + extra(r.choices[0], "token_ids")
    with torch.no_grad():
        lp = plain_model(torch.tensor([ids])).logits[0].log_softmax(-1)  # (T, V)
    P = len(extra(r, "prompt_token_ids"))
    for i, entry in enumerate(r.choices[0].logprobs.content):
        row = lp[P - 1 + i]  # (V,) predicts completion token i
        vals, idx = row.topk(5)
        assert [t.token for t in entry.top_logprobs] == [tok.decode([j]) for j in idx.tolist()]
        np.testing.assert_allclose([t.logprob for t in entry.top_logprobs], vals, atol=ATOL)
        # greedy: the chosen token is the most likely one, with the same logprob
        assert entry.token == entry.top_logprobs[0].token
        assert entry.logprob == pytest.approx(float(vals[0]), abs=ATOL)


def _train_step(tc, tok, lr: float) -> None:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, len(tok), 16).tolist()
    datum = Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": np.ones(15, np.float32)},
    )
    fb = tc.forward_backward([datum], loss_fn="cross_entropy")
    op = tc.optim_step(AdamParams(learning_rate=lr))
    fb.result(WAIT)
    op.result(WAIT)


def test_a_live_session_serves_its_newest_weights(client, svc, tok):
    # every save also becomes a version of this group (the checkpoint registry)
    group = "openai-live"
    tc = svc.create_lora_training_client(TINY, rank=8, seed=3, model_package_group=group)
    prompt = chat_ids(tok, CHAT)
    kw = dict(messages=CHAT, max_tokens=8, seed=21, n=2, logprobs=True, extra_body=IDS)
    first_lps, per_step = [], []
    for _step in range(2):
        _train_step(tc, tok, lr=5e-2)
        sc = tc.save_weights_and_get_sampling_client()
        seqs = sdk_sample(sc, prompt, n=2, max_tokens=8, seed=21)
        per_step.append(seqs)
        # right after the refresh, the model_id serves the refreshed weights...
        live = client.chat.completions.create(model=tc.model_id, **kw)
        assert_same_choices(live.choices, seqs, tok)
        # ...and so does the sampling session itself, named as a model
        by_sampler = client.chat.completions.create(model=sc.sampling_session_id, **kw)
        assert_same_choices(by_sampler.choices, seqs, tok)
        first_lps.append(live.choices[0].logprobs.content[0].logprob)
    base = client.chat.completions.create(model=TINY, **kw)
    assert abs(first_lps[0] - first_lps[1]) > 1e-3, "the second step did not reach the endpoint"
    assert abs(base.choices[0].logprobs.content[0].logprob - first_lps[1]) > 1e-3

    # a saved sampler checkpoint, by its tinker:// path, serves the same weights
    path = tc.save_weights_for_sampler("openai-test").result(WAIT).path
    saved = client.chat.completions.create(model=path, **kw)
    assert_same_choices(saved.choices, seqs, tok)
    # and so do registered versions: the newest, and the first step's refresh (version 1)
    latest = client.chat.completions.create(model=f"{group}:latest", **kw)
    assert_same_choices(latest.choices, per_step[1], tok)
    first = client.chat.completions.create(model=f"{group}:1", **kw)
    assert_same_choices(first.choices, per_step[0], tok)

    listed = [m.id for m in client.models.list()]
    assert TINY in listed and tc.model_id in listed and path in listed
    assert client.models.retrieve(tc.model_id).root == TINY
    tc.stop()
    with pytest.raises(openai.NotFoundError):  # its weights left memory with it
        client.chat.completions.create(model=tc.model_id, **kw)


def test_tools_and_tool_history_reach_the_chat_template(client, tok):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather of a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    call = {"id": "call_1", "type": "function"}
    call["function"] = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    as_template = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {**call, "function": {**call["function"], "arguments": {"city": "Paris"}}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    want = chat_ids(tok, as_template, tools=tools)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}' in tok.decode(want)
    for choice in ("auto", "none"):
        r = client.chat.completions.create(
            model=TINY, messages=messages, tools=tools, tool_choice=choice, max_tokens=3,
            extra_body=IDS,
        )  # fmt: skip
        assert extra(r, "prompt_token_ids") == want
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_bad_input_gets_a_400_naming_the_field_in_openai_shape(client, url):
    def post(body: dict, path: str = "/v1/chat/completions") -> httpx.Response:
        return httpx.post(f"{url}{path}", json=body, timeout=WAIT)

    ok = {"model": TINY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    cases = [
        ({**ok, "temperature": 3}, "temperature"),
        ({**ok, "max_tokens": 10**6}, "max_tokens"),
        ({**ok, "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({**ok, "messages": []}, "messages"),
        ({k: v for k, v in ok.items() if k != "model"}, "model"),
        ({**ok, "messages": [{"content": "no role"}]}, "messages[0].role"),
        ({**ok, "n": 0}, "n"),
        ({**ok, "top_logprobs": 2}, "top_logprobs"),
        ({**ok, "presence_penalty": 5.0}, "presence_penalty"),
        ({**ok, "logit_bias": {"100000": 1}}, "logit_bias"),
        ({**ok, "guided_regex": "(unclosed"}, "guided_regex"),
        (
            {**ok, "response_format": {"type": "json_schema", "json_schema": {}}},
            "response_format.json_schema.schema",
        ),
    ]
    for body, param in cases:
        resp = post(body)
        assert resp.status_code == 400, (param, resp.text)
        err = resp.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["param"] == param and err["type"] == "invalid_request_error", err
        assert param.split("[")[0] in err["message"]
    resp = post({"model": TINY, "prompt": "hi", "logprobs": 9}, "/v1/completions")
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "logprobs"
    for model in ("no-such-model", "tinker://nope/sampler_weights/x", "nosess:train:0"):
        resp = post({**ok, "model": model})
        assert resp.status_code == 404, resp.text
        assert resp.json()["error"]["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=TINY, messages=CHAT, top_p=0)
    assert e.value.body["param"] == "top_p"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x")
    # the Tinker routes keep their own error shape
    resp = httpx.post(f"{url}/api/v1/asample", json={"prompt": 1}, timeout=WAIT)
    assert resp.status_code == 400 and resp.json()["category"] == "user"
    # routing's own errors too: an unknown /v1 route, a wrong method
    resp = httpx.post(f"{url}/v1/embeddings", json={"model": TINY, "input": "x"}, timeout=WAIT)
    assert resp.status_code == 404 and "/v1/embeddings" in resp.json()["error"]["message"]
    resp = httpx.get(f"{url}/v1/chat/completions", timeout=WAIT)
    assert resp.status_code == 405 and resp.json()["error"]["type"]
    resp = httpx.get(f"{url}/api/v1/no_such_route", timeout=WAIT)
    assert resp.status_code == 404 and resp.json()["category"] == "user"
