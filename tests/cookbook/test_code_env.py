"""The code environment with the real sandbox and the tiny model's tokenizer: rewards, the
check_solution turn rendered by the chat template, and the problem formats."""

from __future__ import annotations

import json

import pytest

from treadle.cookbook.code_env import (
    CHECK_SOLUTION_TOOL,
    CodeEnv,
    CodeRenderer,
    GradeSettings,
    builtin_problems,
    extract_code,
    load_problems,
    parse_tool_call,
    problem_from_row,
)
from treadle.sandbox import LocalSandbox, SandboxLimits, grade


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def settings():
    # the box where bubblewrap works (containment is tested in tests/sandbox), else plain runs
    with LocalSandbox(SandboxLimits(timeout_s=5), workers=2, unsafe=True) as box:
        yield GradeSettings(box, timeout_per_test_s=1.0)


def _answer(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False) + tokenizer.encode(
        "<|im_end|>", add_special_tokens=False
    )


def _fenced(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}\n```"


def test_extract_code_and_tool_calls():
    assert extract_code("a\n```python\nx = 1\n```\nb\n```\ny = 2\n```") == "y = 2"
    assert extract_code("no code") is None
    call = '<tool_call>{"name": "check_solution", "arguments": {"code": "print(1)"}}</tool_call>'
    assert parse_tool_call(call) == "print(1)"
    assert extract_code(call) is None  # a tool call is not an answer
    assert parse_tool_call("<tool_call>\n```python\nprint(2)\n```\n</tool_call>") == "print(2)"
    assert parse_tool_call("```python\nprint(3)\n```") is None


def test_builtin_problems_pass_with_their_reference_solutions(settings):
    from importlib import resources

    text = resources.files("treadle.cookbook.data").joinpath("code_problems.jsonl").read_text()
    rows = [json.loads(line) for line in text.splitlines()]
    problems = builtin_problems()
    assert len(problems) == len(rows) >= 12
    futures = [
        settings.sandbox._pool.submit(grade, settings.sandbox, row["solution"], p.tests)
        for row, p in zip(rows, problems, strict=True)
    ]
    assert [f.result().passed for f in futures] == [True] * len(rows)
    # and a wrong solution fails them
    assert not grade(settings.sandbox, "def add(a, b):\n    return a", problems[0].tests).passed


def test_one_turn_rewards(tokenizer, settings):
    problem = builtin_problems()[0]  # add(a, b)
    renderer = CodeRenderer(tokenizer, two_turn=False)

    def reward(text: str):
        env = CodeEnv(problem, renderer, settings)
        prompt = env.initial_observation()
        assert "add(a, b)" in tokenizer.decode(prompt)
        return env.step(_answer(tokenizer, text))

    right = reward(_fenced("def add(a, b):\n    return a + b"))
    assert (right.reward, right.done, right.metrics["pass_rate"]) == (1.0, True, 1.0)
    wrong = reward(_fenced("def add(a, b):\n    return a * b"))
    assert wrong.reward == 0.0 and wrong.metrics["formatted"] == 1.0
    assert 0 < wrong.metrics["pass_rate"] < 1  # 0 * 0 == 0 + 0 passes one test
    missing = reward("def add(a, b): return a + b")
    assert (missing.reward, missing.metrics["formatted"]) == (-0.1, 0.0)


def test_two_turn_tool_result_is_rendered_by_the_chat_template(tokenizer, settings):
    problem = builtin_problems()[0]
    renderer = CodeRenderer(tokenizer, two_turn=True)
    env = CodeEnv(problem, renderer, settings)
    prompt = env.initial_observation()
    call = json.dumps(
        {"name": "check_solution", "arguments": {"code": "def add(a, b):\n    return a - b"}}
    )
    call_text = f"<tool_call>{call}</tool_call>"
    first = env.step(_answer(tokenizer, call_text))
    assert not first.done and first.reward == 0.0
    # the next prompt is exactly what the template renders for the whole conversation
    tool_text = tokenizer.decode(first.next_observation[len(prompt) :], skip_special_tokens=False)
    result = tool_text.split("<|im_start|>tool\n", 1)[1].split("<|im_end|>")[0]
    assert result.startswith("0/2 tests passed.") and "expected 3, got '-1'" in result
    expected = tokenizer.apply_chat_template(
        [
            *renderer.messages(problem),
            {"role": "assistant", "content": call_text},
            {"role": "tool", "name": "check_solution", "content": result},
        ],
        add_generation_prompt=True,
        tools=[CHECK_SOLUTION_TOOL],
        return_dict=True,
    )["input_ids"]
    assert first.next_observation == list(expected)
    final = env.step(_answer(tokenizer, _fenced("def add(a, b):\n    return a + b")))
    assert final.done and final.reward == 1.0 and final.metrics["tool_calls"] == 1.0


def test_two_turn_answer_without_tool_is_graded_at_once(tokenizer, settings):
    env = CodeEnv(builtin_problems()[0], CodeRenderer(tokenizer, True), settings)
    env.initial_observation()
    r = env.step(_answer(tokenizer, _fenced("def add(a, b):\n    return a + b")))
    assert r.done and r.reward == 1.0 and r.metrics["tool_calls"] == 0.0


def test_deepcoder_rows_and_local_jsonl(tmp_path):
    lcb = {
        "problem": "Shift every element by k.",
        "starter_code": "class Solution:\n    def shift(self, xs, k):",
        "tests": json.dumps(
            [
                {
                    "input": "[1, 2]\n3",
                    "output": "[4, 5]",
                    "testtype": "functional",
                    "metadata": json.dumps({"func_name": "shift"}),
                }
            ]
        ),
    }
    taco = {"question": "Add.", "input_output": {"inputs": ["1 2\n"], "outputs": ["3\n"]}}
    p = problem_from_row(lcb)
    assert p.tests[0].fn_name == "shift" and p.tests[0].input == [[1, 2], 3]
    assert "class Solution" in p.prompt
    assert problem_from_row(taco).tests[0].input == "1 2\n"
    assert problem_from_row({"prompt": "x", "tests": []}) is None
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(lcb) + "\n" + json.dumps({"prompt": "bad"}) + "\n")
    assert len(load_problems(str(path))) == 1
