"""What an RL environment is, for the cookbook's loops.

An Env is single-use: it shows the model a prompt (tokens), scores the model's answer, and
says whether the episode continues with another turn. A group is G envs of the same problem,
whose rewards are compared with each other (GRPO). Everything is plain token ids, so an env
works with any tokenizer and any chat format.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass
class StepResult:
    reward: float
    done: bool = True
    # For another turn: the whole context the model sees next (it should extend the previous
    # prompt + answer, so the turns train as one sequence).
    next_observation: list[int] | None = None
    metrics: dict[str, float] = field(default_factory=dict)


class Env(ABC):
    """One episode. `stop` is what ends a turn's sampling (strings or token ids)."""

    stop: list[str] | list[int] | None = None

    @abstractmethod
    def initial_observation(self) -> list[int]: ...

    @abstractmethod
    def step(self, action_tokens: list[int]) -> StepResult: ...


@dataclass
class Transition:
    observation: list[int]
    action: list[int]
    action_logprobs: list[float]
    reward: float
    metrics: dict[str, float]


@dataclass
class Trajectory:
    transitions: list[Transition]

    @property
    def total_reward(self) -> float:
        return sum(t.reward for t in self.transitions)

    @property
    def metrics(self) -> dict[str, float]:
        merged: dict[str, float] = {}
        for t in self.transitions:
            merged.update(t.metrics)
        return merged


# A group builder makes the G envs of one problem; it must be cheap and deterministic.
EnvGroupBuilder = Callable[[int], Sequence[Env]]


class RLDataset(ABC):
    """Batches of env groups by step (deterministic, so a resumed run sees the same data)."""

    @abstractmethod
    def get_batch(self, step: int) -> list[EnvGroupBuilder]: ...

    def test_groups(self) -> list[EnvGroupBuilder]:
        return []
