"""Code problems as RL environments: the model writes a Python solution, unit tests grade it.

One-turn: reward 1 when every test passes, 0 otherwise, and `format_penalty` (-0.1) when the
answer has no fenced code block. Two-turn: the model may first call the `check_solution`
tool; it sees the results on the visible tests as a tool message rendered by its own chat
template (the tokens it would see at inference), answers again, and that answer is graded
on all tests. Problems come in DeepCoder format ({"prompt" | "problem" | "question", "tests"})
from a local JSONL, a `datasets` source, or the small built-in set (`builtin`).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from treadle.cookbook.rl_types import Env, EnvGroupBuilder, RLDataset, StepResult
from treadle.cookbook.run_dir import step_rng
from treadle.errors import InvalidRequestError
from treadle.sandbox import Sandbox, TestCase, grade, parse_tests
from treadle.sandbox.grading import feedback

INSTRUCTION = "Write a Python solution in a fenced code block (```python ... ```)."
TOOL_INSTRUCTION = (
    " Before answering you may test a draft once: reply with <tool_call>"
    '{"name": "check_solution", "arguments": {"code": "..."}}</tool_call> and you will see '
    "the results on the example tests."
)
CHECK_SOLUTION_TOOL = {
    "type": "function",
    "function": {
        "name": "check_solution",
        "description": "Run Python code on the problem's example tests and report the results.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "the full solution"}},
            "required": ["code"],
        },
    },
}
_FENCE = re.compile(r"```(?:[A-Za-z0-9_+-]*)\n(.*?)```", re.DOTALL)
_TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


@dataclass
class CodeProblem:
    prompt: str
    tests: list[TestCase]
    name: str = ""


def extract_code(text: str) -> str | None:
    """The last fenced code block of an answer (outside any tool call), or None."""
    blocks = _FENCE.findall(_TOOL_CALL.sub("", text))
    return blocks[-1].strip() if blocks else None


def parse_tool_call(text: str) -> str | None:
    """The code of a `check_solution` call (JSON arguments, or a fenced block inside the
    <tool_call> tags), or None when the answer calls no tool."""
    match = _TOOL_CALL.search(text)
    if match is None:
        return None
    body = match.group(1).strip()
    try:
        call = json.loads(body)
        if call.get("name") == "check_solution":
            code = (call.get("arguments") or {}).get("code")
            return code if isinstance(code, str) and code.strip() else None
    except (json.JSONDecodeError, AttributeError):
        pass
    blocks = _FENCE.findall(body)
    return blocks[-1].strip() if blocks else None


# ---- rendering -----------------------------------------------------------------------------

_PLACEHOLDER = "\x00ANSWER\x00"


class CodeRenderer:
    """Prompt tokens and tool-result tokens, both from the model's own chat template."""

    def __init__(self, tokenizer, two_turn: bool):
        self.tokenizer, self.two_turn = tokenizer, two_turn

    def _template(self, messages: list[dict], tokenize: bool, add_generation_prompt: bool):
        kwargs: dict[str, Any] = {"tools": [CHECK_SOLUTION_TOOL]} if self.two_turn else {}
        out = self.tokenizer.apply_chat_template(
            messages,
            tokenize=tokenize,
            add_generation_prompt=add_generation_prompt,
            return_dict=tokenize,
            **kwargs,
        )
        return list(out["input_ids"]) if tokenize else out

    def messages(self, problem: CodeProblem) -> list[dict]:
        text = f"{problem.prompt}\n\n{INSTRUCTION}" + (TOOL_INSTRUCTION if self.two_turn else "")
        return [{"role": "user", "content": text}]

    def prompt(self, problem: CodeProblem) -> list[int]:
        return self._template(self.messages(problem), True, True)

    def tool_result(self, problem: CodeProblem, action: list[int], result: str) -> list[int]:
        """Tokens that follow the model's turn: the end of its turn (unless it already wrote
        it), the tool message, and the next assistant header, as the template renders them."""
        call = {"role": "assistant", "content": _PLACEHOLDER}
        tool = {"role": "tool", "name": "check_solution", "content": result}
        text = self._template([*self.messages(problem), call, tool], False, True)
        suffix = text.split(_PLACEHOLDER, 1)[1]
        tokens = self.tokenizer.encode(suffix, add_special_tokens=False)
        if action and tokens and action[-1] == tokens[0]:
            tokens = tokens[1:]  # the model closed its turn itself
        return tokens


# ---- the environment -----------------------------------------------------------------------


@dataclass
class GradeSettings:
    sandbox: Sandbox
    timeout_per_test_s: float = 2.0
    format_penalty: float = -0.1
    max_context: int = 4096  # an episode whose next prompt would not fit ends (reward 0)
    max_tokens: int = 256


class CodeEnv(Env):
    def __init__(self, problem: CodeProblem, renderer: CodeRenderer, settings: GradeSettings):
        self.problem, self.renderer, self.settings = problem, renderer, settings
        self.tokens: list[int] = []
        self.turn = 0
        self.checks = 0
        self.grade_s = 0.0

    def initial_observation(self) -> list[int]:
        self.tokens = self.renderer.prompt(self.problem)
        return self.tokens

    def _grade(self, code: str, tests: list[TestCase]):
        start = time.monotonic()
        verdict = grade(self.settings.sandbox, code, tests, self.settings.timeout_per_test_s)
        self.grade_s += time.monotonic() - start
        return verdict

    def step(self, action_tokens: list[int]) -> StepResult:
        text = self.renderer.tokenizer.decode(action_tokens, skip_special_tokens=True)
        self.turn += 1
        if self.renderer.two_turn and self.turn == 1:
            draft = parse_tool_call(text)
            if draft is not None:
                return self._check(draft, action_tokens)
        return self._final(text)

    def _check(self, draft: str, action: list[int]) -> StepResult:
        self.checks += 1
        visible = self.problem.tests[: max(1, len(self.problem.tests) // 2)]
        verdict = self._grade(draft, visible)
        result = feedback(verdict, visible)
        nxt = self.tokens + action + self.renderer.tool_result(self.problem, action, result)
        if len(nxt) + self.settings.max_tokens > self.settings.max_context:
            return self._end(0.0, {"overflow": 1.0, "formatted": 0.0})
        self.tokens = nxt
        return StepResult(reward=0.0, done=False, next_observation=nxt, metrics={"tool_calls": 1.0})

    def _final(self, text: str) -> StepResult:
        code = extract_code(text)
        if code is None:
            return self._end(self.settings.format_penalty, {"formatted": 0.0})
        verdict = self._grade(code, self.problem.tests)
        return self._end(
            1.0 if verdict.passed else 0.0, {"formatted": 1.0, "pass_rate": verdict.pass_rate}
        )

    def _end(self, reward: float, metrics: dict[str, float]) -> StepResult:
        metrics = {
            "correct": float(reward > 0),
            "pass_rate": 0.0,
            **metrics,
            "tool_calls": float(self.checks),
            "grade_s": self.grade_s,
        }
        return StepResult(reward=reward, done=True, metrics=metrics)


class CodeDataset(RLDataset):
    """Batches of `batch_size` problems by step, drawn with a per-step seed (resumable)."""

    def __init__(
        self,
        train: list[CodeProblem],
        test: list[CodeProblem],
        renderer: CodeRenderer,
        settings: GradeSettings,
        batch_size: int,
        seed: int = 0,
    ):
        if not train:
            raise InvalidRequestError("dataset: expected at least one training problem, got none")
        self.train, self.test, self.renderer, self.settings = train, test, renderer, settings
        self.batch_size, self.seed = batch_size, seed

    def builder(self, problem: CodeProblem) -> EnvGroupBuilder:
        return lambda g: [CodeEnv(problem, self.renderer, self.settings) for _ in range(g)]

    def get_batch(self, step: int) -> list[EnvGroupBuilder]:
        rng = step_rng(self.seed, step)
        n = min(self.batch_size, len(self.train))
        return [self.builder(p) for p in rng.sample(self.train, n)]

    def test_groups(self) -> list[EnvGroupBuilder]:
        return [self.builder(p) for p in self.test]


# ---- data ----------------------------------------------------------------------------------


def problem_from_row(row: dict) -> CodeProblem | None:
    """A DeepCoder / LiveCodeBench / TACO row → CodeProblem (None when unusable)."""
    prompt = row.get("prompt") or row.get("problem") or row.get("question")
    tests = row.get("tests") or row.get("ground_truth") or row.get("input_output")
    if not isinstance(prompt, str) or not prompt.strip() or not tests:
        return None
    meta = row.get("metadata") or {}
    meta = json.loads(meta) if isinstance(meta, str) and meta.strip() else meta
    fn_name = (meta.get("func_name") if isinstance(meta, dict) else None) or row.get("fn_name")
    try:
        cases = parse_tests(tests, fn_name)
    except (ValueError, KeyError, TypeError):
        return None
    starter = row.get("starter_code")
    if isinstance(starter, str) and starter.strip():
        prompt += f"\n\nStart from:\n```python\n{starter.strip()}\n```"
    return CodeProblem(prompt, cases, str(row.get("name", ""))) if cases else None


def builtin_problems() -> list[CodeProblem]:
    text = resources.files("treadle.cookbook.data").joinpath("code_problems.jsonl").read_text()
    return _rows_to_problems(json.loads(line) for line in text.splitlines() if line.strip())


def load_problems(source: str, split: str = "train", subset: str | None = None):
    """`builtin`, a local .jsonl file, or a `datasets` source (e.g.
    agentica-org/DeepCoder-Preview-Dataset with `subset` lcbv5)."""
    if source == "builtin":
        return builtin_problems()
    path = Path(source)
    if path.suffix == ".jsonl":
        lines = path.read_text().splitlines()
        return _rows_to_problems(json.loads(line) for line in lines if line.strip())
    try:
        import datasets
    except ImportError as exc:
        raise InvalidRequestError(
            f"dataset: {source!r} is not a .jsonl file and `datasets` is not installed"
        ) from exc
    return _rows_to_problems(datasets.load_dataset(source, subset, split=split))


def _rows_to_problems(rows) -> list[CodeProblem]:
    return [p for p in (problem_from_row(dict(r)) for r in rows) if p is not None]
