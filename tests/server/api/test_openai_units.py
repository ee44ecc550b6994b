"""Units of the OpenAI-compatible layer that need no server: tool-call parsing, stop-string
cutting and incremental detokenization, error shapes and request checks.

    .venv/bin/python -m pytest -q tests/server/api/test_openai_units.py
"""

from __future__ import annotations

import json

import pytest

from treadle.errors import InvalidRequestError
from treadle.server.api.openai.errors import error_body, param_of
from treadle.server.api.openai.render import TokenText, decode_output
from treadle.server.api.openai.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    check_chat,
    check_completion,
    prompts_of,
)
from treadle.server.api.openai.tools import parse_tool_calls, template_tool_calls


def test_tool_calls_are_parsed_and_the_rest_stays_content():
    text = (
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>{"name": "now", "arguments": {}}</tool_call>'
    )
    out = parse_tool_calls(text)
    assert out.content == "Let me look."
    assert [c["function"]["name"] for c in out.tool_calls] == ["get_weather", "now"]
    assert json.loads(out.tool_calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in out.tool_calls)
    assert len({c["id"] for c in out.tool_calls}) == 2


def test_a_block_that_is_not_a_call_is_left_as_text():
    for text in ("<tool_call>not json</tool_call>", '<tool_call>{"x": 1}</tool_call>', "plain"):
        out = parse_tool_calls(text)
        assert out.content == text and out.tool_calls == []
    # an unterminated block at the very end (max_tokens hit after the JSON) still parses
    out = parse_tool_calls('<tool_call>{"name": "f", "arguments": {"a": 1}}')
    assert out.content is None and out.tool_calls[0]["function"]["name"] == "f"


def test_history_tool_calls_reach_the_template_with_mapping_arguments():
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]
    assert template_tool_calls(calls)[0]["function"]["arguments"] == {"a": 1}


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_pieces_add_up_to_the_text_and_stops_are_cut(tok):
    text = "Two plus three is 5. The sun is a star."
    ids = tok.encode(text, add_special_tokens=False)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    out = decode_output(tok, ids + [end], [], "stop")
    assert out.text == text and "".join(out.pieces_T) == text  # the EOS adds no text
    assert len(out.pieces_T) == len(ids) + 1 and out.finish_reason == "stop"
    cut = decode_output(tok, ids, ["sun", " three"], "length")
    # the earliest stop wins and is left out of the text, as OpenAI does
    assert cut.text == "Two plus" and "".join(cut.pieces_T) == "Two plus"
    assert cut.finish_reason == "stop"
    assert decode_output(tok, ids, ["zebra"], "length").finish_reason == "length"


def test_multibyte_characters_come_out_whole(tok):
    text = "café ☕ ok"
    ids = tok.encode(text, add_special_tokens=False)
    out = decode_output(tok, ids, [], "length")
    assert "".join(out.pieces_T) == text
    assert all("\ufffd" not in p for p in out.pieces_T)
    tt = TokenText(tok)
    assert b"".join(bytes(tt.bytes_of(t)) for t in ids) == text.encode()


def test_errors_name_their_param():
    assert param_of("temperature: expected ...") == "temperature"
    assert param_of("messages[2].content[0]: only text") == "messages[2].content[0]"
    assert param_of("no field here") is None
    body = error_body("model: 'x' not found", 404)
    assert body == {
        "error": {
            "message": "model: 'x' not found",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    assert error_body("boom", 500)["error"]["type"] == "server_error"


def _chat(**kw):
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **kw)


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": -1}, "max_completion_tokens"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"stop": ["a", ""]}, "stop[1]"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": float("nan")}, "presence_penalty"),
        ({"logit_bias": {"x": 2.0}}, "logit_bias"),
        ({"logit_bias": {"7": 101}}, "logit_bias[7]"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema.schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": "{oops"}}},
            "response_format.json_schema.schema",
        ),
        ({"guided_regex": "a(b"}, "guided_regex"),
        ({"guided_grammar": "start: nothing_here"}, "guided_grammar"),
        ({"structured_outputs": {"regex": "[a"}}, "structured_outputs.regex"),
        ({"guided_choice": ["a", "b"]}, "guided_choice"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_bad_chat_settings_name_the_field(kw, param):
    with pytest.raises(InvalidRequestError) as e:
        check_chat(_chat(**kw))
    assert param_of(str(e.value)) == param


def test_good_settings_pass_and_map_one_to_one():
    spec = check_chat(
        _chat(max_completion_tokens=5, max_tokens=9, seed=3, n=2, stop="x", logprobs=True)
    )
    assert (spec.max_tokens, spec.seed, spec.n, spec.stop, spec.logprobs) == (5, 3, 2, ["x"], True)
    spec = check_completion(CompletionRequest(model="m", prompt=[1, 2, 3], logprobs=0))
    assert spec.max_tokens == 16 and spec.logprobs and spec.top_logprobs == 0  # OpenAI's default
    assert prompts_of(CompletionRequest(model="m", prompt=[[1, 2], [3]])) == [[1, 2], [3]]
    assert prompts_of(CompletionRequest(model="m", prompt=["a", "b"])) == ["a", "b"]
    with pytest.raises(InvalidRequestError, match=r"^echo:"):
        check_completion(CompletionRequest(model="m", prompt="a", echo=True))
    with pytest.raises(InvalidRequestError, match=r"^prompt\[1\]:"):
        prompts_of(CompletionRequest(model="m", prompt=["a", ""]))


def test_a_tool_call_answer_in_openai_types_plain_and_streamed(tok):
    """A sampled tool call, shaped as a response and as chunks; the openai library's own
    types parse both, and its stream accumulator rebuilds the same message from the chunks."""
    pytest.importorskip("openai")
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    from treadle.server.api.openai.completions import Choice, Result, chat_response
    from treadle.server.api.openai.sampling import Sampled
    from treadle.server.api.openai.schemas import Sampling
    from treadle.server.api.openai.stream import chat_chunks

    text = 'Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    tokens = tok.encode(text, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    sampled = Sampled(tokens, [-0.5] * len(tokens), "stop")
    decoded = decode_output(tok, tokens, [], "stop")
    choice = Choice(0, sampled, decoded, parse_tool_calls(decoded.text))
    spec = Sampling(max_tokens=64, logprobs=True, include_usage=True)
    result = Result("chatcmpl-x", 0, "m", spec, [[1, 2, 3]], [choice], TokenText(tok))

    plain = ChatCompletion.model_validate(chat_response(result))
    (c,) = plain.choices
    assert c.finish_reason == "tool_calls" and c.message.content == "Sure."
    assert c.message.tool_calls[0].function.name == "get_weather"
    assert json.loads(c.message.tool_calls[0].function.arguments) == {"city": "Paris"}
    assert plain.usage.completion_tokens == len(tokens) and len(c.logprobs.content) == len(tokens)

    state = ChatCompletionStreamState()
    chunks = [ChatCompletionChunk.model_validate(ch) for ch in chat_chunks(result)]
    for chunk in chunks:
        state.handle_chunk(chunk)
    streamed = state.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls" and streamed.message.content == "Sure."
    call = streamed.message.tool_calls[0]
    assert (call.id, call.function.name) == (c.message.tool_calls[0].id, "get_weather")
    assert call.function.arguments == c.message.tool_calls[0].function.arguments
    assert chunks[-1].usage.total_tokens == 3 + len(tokens)
