"""Sampling controls through a real server: the `treadle` SDK's SamplingParams fields, the
/v1 request fields (response_format, guided_regex, logit_bias, ...) through the official
openai client, raw Tinker-wire requests, and the official tinker SDK still decoding sample
results that carry sampling_logprobs.

    .venv/bin/python -m pytest -q tests/server/api/test_sampling_controls.py
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from treadle import ModelInput, SamplingParams, ServiceClient
from treadle.errors import TreadleError

openai = pytest.importorskip("openai")

TINY = "treadle/tiny-llama"
API_KEY = "tml-treadle-tests"
WAIT = 120
SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "integer", "minimum": 0, "maximum": 999},
        "sure": {"type": "boolean"},
        "unit": {"enum": ["apples", "coins"]},
    },
    "required": ["answer", "sure", "unit"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}-[0-9]{3}"
CHAT = [{"role": "user", "content": "How many apples? Answer in JSON."}]


@pytest.fixture(scope="module")
def url(treadle_server) -> str:
    return treadle_server.url


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=WAIT)


@pytest.fixture(scope="module")
def sampler(url):
    with ServiceClient(base_url=url, api_key=API_KEY) as svc:
        yield svc.create_sampling_client(base_model=TINY)


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _text(tok, tokens: list[int]) -> str:
    eos = {tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")}
    if tokens and tokens[-1] in eos:
        tokens = tokens[:-1]
    return tok.decode(tokens)


def test_chat_json_schema_choices_parse_and_validate(client):
    r = client.chat.completions.create(
        model=TINY,
        messages=CHAT,
        n=4,
        max_tokens=60,
        seed=3,
        logprobs=True,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
        extra_body={"return_token_ids": True},
    )
    for c in r.choices:
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
        assert c.finish_reason == "stop"
        slp = c.model_extra["sampling_logprobs"]
        assert len(slp) == len(c.model_extra["token_ids"]) == len(c.logprobs.content)
        assert all(x <= 0 for x in slp)
    r = client.chat.completions.create(
        model=TINY, messages=CHAT, max_tokens=60, seed=4, response_format={"type": "json_object"}
    )  # any JSON object: it may run out of tokens, but what it wrote is an object's start
    assert r.choices[0].message.content.startswith("{")


def test_completion_regex_and_logit_bias(client, tok):
    r = client.completions.create(
        model=TINY, prompt="Code:", n=4, max_tokens=30, seed=1,
        extra_body={"guided_regex": REGEX, "return_token_ids": True},
    )  # fmt: skip
    for c in r.choices:
        assert re.fullmatch(REGEX, c.text), c.text
    free = client.completions.create(
        model=TINY,
        prompt="Max has",
        n=4,
        max_tokens=16,
        seed=2,
        extra_body={"return_token_ids": True},
    )
    banned = sorted({t for c in free.choices for t in c.model_extra["token_ids"]})[:50]
    r = client.completions.create(
        model=TINY, prompt="Max has", n=4, max_tokens=16, seed=2,
        logit_bias={str(t): -100 for t in banned}, extra_body={"return_token_ids": True},
    )  # fmt: skip
    for c in r.choices:
        assert not set(c.model_extra["token_ids"]) & set(banned)


def test_sdk_fields_constrain_and_report_sampling_logprobs(sampler, tok):
    prompt = ModelInput.from_ints(tok.encode("Ana has 3 apples."))
    params = SamplingParams(max_tokens=60, seed=5, json_schema=SCHEMA, temperature=0.8)
    res = sampler.sample(prompt, num_samples=3, sampling_params=params).result(WAIT)
    for s in res.sequences:
        jsonschema.validate(json.loads(_text(tok, s.tokens)), SCHEMA)
        assert len(s.sampling_logprobs) == len(s.logprobs) == len(s.tokens)
    params = SamplingParams(max_tokens=30, seed=6, regex=REGEX, repetition_penalty=1.2, min_p=0.05)
    res = sampler.sample(prompt, num_samples=2, sampling_params=params).result(WAIT)
    for s in res.sequences:
        assert re.fullmatch(REGEX, _text(tok, s.tokens))
    plain = sampler.sample(prompt, 1, SamplingParams(max_tokens=4, seed=1)).result(WAIT)
    assert plain.sequences[0].sampling_logprobs is None  # the raw policy: logprobs say it all
    with pytest.raises(TreadleError, match=r"sampling_params\.regex"):
        sampler.sample(prompt, 1, SamplingParams(max_tokens=4, regex="a(")).result(WAIT)
    with pytest.raises(TreadleError, match="only one constraint"):
        both = SamplingParams(max_tokens=4, regex="a", grammar='start: "a"')
        sampler.sample(prompt, 1, both).result(WAIT)


def test_tinker_wire_takes_the_extra_fields_and_refuses_bad_ones(url, sampler, tok):
    """Raw JSON on /api/v1/asample: the Tinker body plus the extension fields."""
    headers = {"X-API-Key": API_KEY, "Authorization": f"Bearer {API_KEY}"}
    body = {
        "sampling_session_id": sampler.sampling_session_id,
        "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": tok.encode("Hi")}]},
        "sampling_params": {"max_tokens": 4, "logit_bias": {"5": 200.0}},
    }
    resp = httpx.post(f"{url}/api/v1/asample", json=body, headers=headers, timeout=WAIT)
    assert resp.status_code == 400 and "logit_bias[5]" in resp.text, resp.text


def test_tinker_sdk_decodes_results_that_carry_sampling_logprobs(url, tok):
    tinker = pytest.importorskip("tinker")
    sc = tinker.ServiceClient(base_url=url, api_key=API_KEY)
    s = sc.create_sampling_client(base_model=TINY).result()
    params = tinker.types.SamplingParams(max_tokens=5, seed=1, temperature=0.5)
    prompt = tinker.types.ModelInput.from_ints(tok.encode("Hi"))
    res = s.sample(prompt=prompt, num_samples=2, sampling_params=params).result(timeout=WAIT)
    assert [len(q.tokens) for q in res.sequences] == [len(q.logprobs) for q in res.sequences]
