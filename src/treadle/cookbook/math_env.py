"""Math word problems as RL environments: GSM8K (answer after ####) and offline arithmetic.

The reward is 1 for a right final answer. With `strict`, every equation of the working must
also hold: on arithmetic a small model otherwise learns to write broken working that lands on
the right number (reward hacking). An answer with no `####` gets `format_penalty`.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from treadle.arithmetic import final_number, problem, strict_reward, worked_answer
from treadle.cookbook.rl_types import Env, EnvGroupBuilder, RLDataset, StepResult
from treadle.cookbook.run_dir import step_rng
from treadle.cookbook.sft import chat_tokens

INSTRUCTION = " Show your working, then give the final answer after ####."


@dataclass
class MathProblem:
    question: str
    answer: int


class Prompter:
    """Turns a question into prompt tokens: `raw` ("Question: ...\\nAnswer:") or `chat`."""

    def __init__(self, tokenizer, prompt_format: str = "chat"):
        if prompt_format not in ("raw", "chat"):
            raise ValueError(f"prompt_format must be 'raw' or 'chat', got {prompt_format!r}")
        self.tokenizer = tokenizer
        self.prompt_format = prompt_format

    def __call__(self, question: str) -> list[int]:
        if self.prompt_format == "raw":
            return self.tokenizer.encode(f"Question: {question}\nAnswer:", add_special_tokens=False)
        messages = [{"role": "user", "content": question + INSTRUCTION}]
        return chat_tokens(self.tokenizer, messages, add_generation_prompt=True)


class MathEnv(Env):
    def __init__(
        self, prompt: list[int], answer: int, tokenizer, strict: bool, format_penalty: float = 0.0
    ):
        self.prompt, self.answer, self.tokenizer = prompt, answer, tokenizer
        self.strict, self.format_penalty = strict, format_penalty

    def initial_observation(self) -> list[int]:
        return self.prompt

    def step(self, action_tokens: list[int]) -> StepResult:
        text = self.tokenizer.decode(action_tokens, skip_special_tokens=True)
        value = final_number(text)
        correct = float(value == self.answer)
        reward = strict_reward(text, self.answer) if self.strict else correct
        if value is None:
            reward += self.format_penalty
        return StepResult(
            reward=reward, metrics={"correct": correct, "formatted": float(value is not None)}
        )


class MathDataset(RLDataset):
    """Batches of `batch_size` problems by step, drawn with a per-step seed (resumable)."""

    def __init__(
        self,
        train: list[MathProblem],
        test: list[MathProblem],
        prompter: Prompter,
        batch_size: int,
        strict: bool,
        seed: int = 0,
        format_penalty: float = 0.0,
    ):
        self.train, self.test, self.prompter = train, test, prompter
        self.batch_size, self.strict, self.seed = batch_size, strict, seed
        self.format_penalty = format_penalty

    def _builder(self, p: MathProblem) -> EnvGroupBuilder:
        prompt = self.prompter(p.question)
        tok = self.prompter.tokenizer
        return lambda g: [
            MathEnv(prompt, p.answer, tok, self.strict, self.format_penalty) for _ in range(g)
        ]

    def get_batch(self, step: int) -> list[EnvGroupBuilder]:
        rng = step_rng(self.seed, step)
        return [self._builder(p) for p in rng.sample(self.train, self.batch_size)]

    def test_groups(self) -> list[EnvGroupBuilder]:
        return [self._builder(p) for p in self.test]


def arithmetic_problems(n: int, seed: int, max_operand: int = 20) -> list[MathProblem]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        question, steps = problem(rng, max_operand)
        out.append(MathProblem(question, worked_answer(steps)[1]))
    return out


def load_gsm8k(source: str, split: str) -> list[MathProblem]:
    """`openai/gsm8k` through `datasets`, or a local JSONL/parquet file of {question, answer}."""
    path = Path(source)
    if path.suffix == ".jsonl":
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    elif path.suffix == ".parquet":
        import pandas as pd

        rows = pd.read_parquet(path).to_dict("records")
    else:
        import datasets

        rows = list(datasets.load_dataset(source, "main", split=split))
    problems = []
    for row in rows:
        value = final_number(row["answer"].replace(",", ""))
        if value is not None:
            problems.append(MathProblem(row["question"], value))
    return problems
