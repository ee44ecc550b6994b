"""Arithmetic word problems in the GSM8K style, and a strict verifier for their answers.

    Max has 3 balls. He finds 16 more. He gives away 9. How many balls does Max have now?
    3+16=19. 19-9=10. #### 10

Pure Python: the tiny model's tokenizer is trained on these texts and the cookbook's offline
math environment uses them, so both sides see the same format.
"""

from __future__ import annotations

import random
import re

NAMES = ["Max", "Ana", "Li", "Sam", "Omar", "Mia", "Ben", "Zoe", "Ivan", "Nia"]
OBJECTS = [
    "apples",
    "balls",
    "books",
    "coins",
    "pens",
    "cards",
    "shells",
    "stamps",
    "cups",
    "rocks",
]
ADD = ["finds {n} more", "buys {n} more", "gets {n} more"]
SUB = ["gives away {n}", "loses {n}", "sells {n}"]

_EQUATION = re.compile(r"(\d+)\s*([+\-])\s*(\d+)\s*=\s*(\d+)")
_FINAL = re.compile(r"####\s*(-?\d+)")


def problem(rng: random.Random, max_operand: int = 20) -> tuple[str, list[tuple[int, str, int]]]:
    """A question and its steps [(left, op, n), ...]; 1 or 2 steps, never below zero."""
    name, obj = rng.choice(NAMES), rng.choice(OBJECTS)
    value = rng.randint(1, max_operand)
    question = f"{name} has {value} {obj}."
    steps = []
    for _ in range(rng.randint(1, 2)):
        n = rng.randint(1, max_operand)
        op = "+" if rng.random() < 0.5 or n > value else "-"
        question += " He " + rng.choice(ADD if op == "+" else SUB).format(n=n) + "."
        steps.append((value, op, n))
        value = value + n if op == "+" else value - n
    question += f" How many {obj} does {name} have now?"
    return question, steps


def worked_answer(
    steps: list[tuple[int, str, int]], rng: random.Random | None = None, corrupt: bool = False
) -> tuple[str, int]:
    """The working and its final value. `corrupt` (needs rng) puts one wrong step in: an
    off-by-one result or + and - swapped, 50/50; later steps go on from the wrong value."""
    bad = rng.randrange(len(steps)) if corrupt else -1
    swap = corrupt and rng.random() < 0.5
    value = steps[0][0]
    parts = []
    for i, (_, op, n) in enumerate(steps):
        if i == bad and swap:
            op = "-" if op == "+" else "+"
        result = value + n if op == "+" else value - n
        if i == bad and not swap:
            result += rng.choice([-1, 1])
        parts.append(f"{value}{op}{n}={result}.")
        value = result
    return " ".join(parts) + f" #### {value}", value


def answer_value(steps: list[tuple[int, str, int]]) -> int:
    return worked_answer(steps)[1]


def final_number(text: str) -> int | None:
    match = _FINAL.search(text)
    return int(match.group(1)) if match else None


def strict_reward(text: str, answer: int) -> float:
    """1 only if the final number is right AND every equation in the working is valid:
    a right number reached through broken arithmetic must not be rewarded."""
    if final_number(text) != answer:
        return 0.0
    for a, op, b, c in _EQUATION.findall(text.split("####")[0]):
        if (int(a) + int(b) if op == "+" else int(a) - int(b)) != int(c):
            return 0.0
    return 1.0
