"""POST /v1/messages through the official `anthropic` client, against a real server on the
tiny model with two tenants.

Checked against independent computations: the prompt the chat template renders here with
transformers (input_tokens, and the captured prompt tokens of a tool-result turn), and the
answer /v1/chat/completions gives for the same seed. The tool-use round trip runs on a live
session trained here (cross-entropy, to a loss near 0) to answer one prompt with one tool
call, so that its greedy answer is known: the tiny model's own output is random.

    .venv/bin/python -m pytest -q tests/server/api/test_anthropic_api.py
"""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
from _tenancy import TINY, make_tenants, start_server

from treadle import AdamParams, Datum, ModelInput, ServiceClient

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

WAIT = 120
SYSTEM = "Be brief."
ASK = [{"role": "user", "content": "What is 2+3?"}]
TOOLS = [
    {
        "name": "get_weather",
        "description": "Weather of a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]
AS_OPENAI_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": t["name"],
            "description": t["description"],
            "parameters": t["input_schema"],
        },
    }
    for t in TOOLS
]
WEATHER = [{"role": "user", "content": "Weather in Paris?"}]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call><|im_end|>'


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    data = tmp_path_factory.mktemp("anthropic")
    keys = make_tenants(data, {"alice": None, "bob": None})
    srv = start_server({TINY: tiny_model_dir}, data, None)
    srv.keys = keys
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(
        base_url=server.url, api_key=server.keys["alice"], max_retries=0, timeout=WAIT
    )


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def chat_ids(tok, messages, **kw) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)
    return tok.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def tool_caller(server, tok):
    """A live session trained to answer WEATHER (with TOOLS) by calling get_weather."""
    svc = ServiceClient(base_url=server.url, api_key=server.keys["alice"])
    tc = svc.create_lora_training_client(TINY, rank=32, seed=0)
    prompt = chat_ids(tok, WEATHER, tools=AS_OPENAI_TOOLS)
    target = tok.encode(CALL, add_special_tokens=False)
    full = prompt + target
    weights = np.array([0.0] * (len(prompt) - 1) + [1.0] * len(target), np.float32)
    datum = Datum(
        model_input=ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={"target_tokens": full[1:], "weights": weights},
    )
    for _ in range(150):
        fb = tc.forward_backward([datum], loss_fn="cross_entropy")
        tc.optim_step(AdamParams(learning_rate=3e-3)).result(WAIT)
        if fb.result(WAIT).metrics["loss:sum"] < 0.05:
            break
    yield svc, tc, len(target)
    svc.close()


def long_answer_seed(client, **kw) -> tuple[int, str]:
    """A seed whose answer has some text (the random model may end at once)."""
    for seed in range(40):
        r = client.messages.create(**kw, extra_body={"seed": seed})
        if len(r.content[0].text) >= 8:
            return seed, r.content[0].text
    raise AssertionError("no seed in 0..39 gave 8 characters of text")


def test_a_message_is_the_chat_completion_of_the_same_seed(server, client, tok):
    oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.keys["alice"], max_retries=0)
    kw = dict(model=TINY, max_tokens=12, system=SYSTEM, messages=ASK)
    seed, _ = long_answer_seed(client, **kw)
    r = client.messages.create(**kw, extra_body={"seed": seed, "temperature": 0.9, "top_k": 50})
    chat = oai.chat.completions.create(
        model=TINY,
        messages=[{"role": "system", "content": SYSTEM}, *ASK],
        max_tokens=12,
        seed=seed,
        temperature=0.9,
        extra_body={"top_k": 50, "return_token_ids": True},
    )
    assert r.type == "message" and r.role == "assistant" and r.model == TINY
    assert [b.type for b in r.content] == ["text"]
    assert r.content[0].text == chat.choices[0].message.content
    want = chat_ids(tok, [{"role": "system", "content": SYSTEM}, *ASK])
    assert r.usage.input_tokens == len(want) == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    stop = {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    assert r.stop_reason == stop and r.stop_sequence is None


def test_streaming_gives_the_same_message_and_stop_sequences_cut(client):
    kw = dict(model=TINY, max_tokens=16, messages=ASK)
    seed, text = long_answer_seed(client, **kw)
    whole = client.messages.create(**kw, extra_body={"seed": seed})
    events = list(client.messages.create(**kw, stream=True, extra_body={"seed": seed}))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1] == "content_block_start" and "content_block_stop" in kinds
    streamed = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert streamed == text
    assert events[-2].delta.stop_reason == whole.stop_reason
    assert events[-2].usage.output_tokens == whole.usage.output_tokens
    with client.messages.stream(**kw, extra_body={"seed": seed}) as s:
        final = s.get_final_message()
    assert final.content[0].text == text
    # a stop sequence from inside the answer: the text ends before it, and it is named
    stop = text[3:6]
    cut = client.messages.create(**kw, stop_sequences=[stop], extra_body={"seed": seed})
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.find(stop)]


def test_a_tool_use_round_trip(server, client, tok, tool_caller):
    svc, tc, n_call = tool_caller
    kw = dict(model=tc.model_id, max_tokens=n_call + 4, tools=TOOLS)
    r = client.messages.create(**kw, messages=WEATHER, extra_body={"temperature": 0})
    assert r.stop_reason == "tool_use", r.content
    (use,) = [b for b in r.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input == {"city": "Paris"}
    assert use.id.startswith("toolu_")
    # streamed: the same call, as a tool_use block with its input as JSON deltas
    with client.messages.stream(**kw, messages=WEATHER, extra_body={"temperature": 0}) as s:
        final = s.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content if b.type == "tool_use"] == [
        ("tool_use", "get_weather", {"city": "Paris"})
    ]
    # the call goes back with its result; the prompt the server rendered (as captured) is
    # the chat template's rendering of the OpenAI form of the conversation
    capture = svc.create_capture_session()
    history = [
        *WEATHER,
        {"role": "assistant", "content": r.content},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}],
        },
    ]
    client.messages.create(
        **kw,
        messages=history,
        extra_headers=capture.headers("t"),
        extra_body={"temperature": 0},
    )
    call = {"id": use.id, "type": "function"}
    call["function"] = {"name": "get_weather", "arguments": {"city": "Paris"}}
    as_template = [
        *WEATHER,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": use.id, "content": "sunny"},
    ]
    (done,) = capture.completions()
    assert done["prompt_tokens"] == chat_ids(tok, as_template, tools=AS_OPENAI_TOOLS)
    assert "<|im_start|>tool\nsunny<|im_end|>" in tok.decode(done["prompt_tokens"])


def test_checkpoints_and_sampling_sessions_answer_as_the_live_session(client, tool_caller):
    svc, tc, n_call = tool_caller
    kw = dict(max_tokens=n_call + 4, tools=TOOLS, messages=WEATHER, extra_body={"temperature": 0})
    live = client.messages.create(model=tc.model_id, **kw)
    path = tc.save_weights_for_sampler("anthropic-test").result(WAIT).path
    sc = tc.save_weights_and_get_sampling_client()
    for model in (path, sc.sampling_session_id):
        r = client.messages.create(model=model, **kw)
        assert r.stop_reason == live.stop_reason == "tool_use"
        assert [b.input for b in r.content] == [b.input for b in live.content]


def test_keys_tenancy_and_errors_in_anthropic_shape(server, client, tool_caller):
    _, tc, _ = tool_caller
    url = server.url
    bearer = anthropic.Anthropic(
        base_url=url, auth_token=server.keys["alice"], api_key=None, max_retries=0
    )
    assert bearer.messages.create(model=TINY, max_tokens=2, messages=ASK).type == "message"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=url, api_key="tml-wrong", max_retries=0).messages.create(
            model=TINY, max_tokens=2, messages=ASK
        )
    bob = anthropic.Anthropic(base_url=url, api_key=server.keys["bob"], max_retries=0)
    with pytest.raises(anthropic.NotFoundError):  # alice's live session is not bob's
        bob.messages.create(model=tc.model_id, max_tokens=2, messages=ASK)
    with pytest.raises(anthropic.BadRequestError, match="tool_choice"):
        client.messages.create(
            model=TINY, max_tokens=2, messages=ASK, tools=TOOLS, tool_choice={"type": "any"}
        )
    with pytest.raises(anthropic.BadRequestError, match=r"messages\[0\].content\[0\]"):
        client.messages.create(
            model=TINY,
            max_tokens=2,
            messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}],
        )
    reply = httpx.post(
        f"{url}/v1/messages",
        json={"model": TINY, "messages": ASK},  # no max_tokens
        headers={"x-api-key": server.keys["alice"]},
    )
    assert reply.status_code == 400
    body = reply.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]
    assert json.loads(reply.text)["error"]["message"].startswith("invalid request")
