"""The engine handle the rest of the server sees: one per served base model.

The API never touches an Engine, its thread or its memory: it submits typed ops
(treadle.protocol.ops) and hears their outcomes through the callback it gave, makes control
calls by name (one table: treadle.worker.loop's), and asks what it is serving. The one
implementation is a worker (a process, a torchrun group, or a thread of this process, all
over the same socket protocol) behind a WorkerEngine, several of them behind a
ReplicatedEngine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from treadle.protocol.facts import EngineFacts, ReplicaStatus, StateSnapshot
from treadle.protocol.ops import Op, Outcome, Progress

OnOutcomes = Callable[[list[Outcome]], None]  # called from the engine's side; must not block
# tokens of streamed sample ops as they are sampled (engine side; must not block)
OnProgress = Callable[[list[Progress]], None]
OnSnapshot = Callable[[StateSnapshot], None]  # a model's state was written


class EngineClient(ABC):
    """Submit ops, make control calls, say what serves. Safe from the event loop."""

    facts: EngineFacts

    @property
    def name(self) -> str:
        return self.facts.name

    @abstractmethod
    def submit(self, op: Op) -> None:
        """Queue an op; its Outcome reaches the on_outcomes callback (never raises). A
        sample op with `stream` set also reports its tokens to on_progress as they come."""

    @abstractmethod
    async def call(self, name: str, **args: Any) -> Any:
        """A control call on the engine's side (load_sampler, drop_ref, check_adapter,
        unload_model, restore_model, snapshot_all): its value, or its error raised."""

    @abstractmethod
    def status(self) -> list[ReplicaStatus]:
        """Each worker group serving this model (`treadle status`, the console)."""

    @abstractmethod
    def is_live(self, ref: str) -> bool:
        """Whether a sampler's weights (a snapshot or a loaded checkpoint) are in a
        worker's memory, as the workers last said (REFS messages): a sample of a freed
        sampler is refused at the edge instead of failing in the engine."""


def overall(statuses: list[ReplicaStatus]) -> str:
    """One word for the console: serving, serving (k of n replicas), restoring, down."""
    serving = sum(s.status == "serving" for s in statuses)
    if len(statuses) == 1:
        return statuses[0].status
    return f"serving ({serving} of {len(statuses)} replicas)" if serving else "down"
