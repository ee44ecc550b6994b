"""The engine handle the rest of the server sees: one per served base model.

The API side never touches an Engine, its thread or its memory: it submits typed ops
(treadle.server.runtime.ops), hears their outcomes through the callback it gave, asks facts,
and makes a few control calls. Today the one implementation runs the engine on a thread of
this process (treadle.server.runtime.engine_loop.EngineLoop); an engine in a process of its
own implements the same interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from treadle.server.runtime.ops import Op, Outcome, Progress

OnOutcomes = Callable[[list[Outcome]], None]  # called from the engine's side; must not block
# tokens of streamed sample ops as they are sampled (engine side; must not block)
OnProgress = Callable[[list[Progress]], None]
OnSnapshot = Callable[[Any], None]  # a model's state was written (a live_weights.StateSnapshot)


@dataclass(frozen=True)
class SnapshotPolicy:
    """When a model's state is written to disk, so that recovery replays little."""

    every_steps: int = 10
    """After this many optimizer steps (or loads) since the last snapshot."""
    every_s: float = 60.0
    """Or this long after the first change since the last snapshot."""


@dataclass(frozen=True)
class EngineFacts:
    """What the API needs to know about a served model to check requests at its edge."""

    name: str
    vocab_size: int  # token ids are [0, vocab_size)
    max_seq_len: int  # the model's context
    max_lora_rank: int  # the largest rank any targeted layer can use
    arch: str | None = None  # the HF model_type, for get_info
    max_train_tokens: int = 0  # the longest sequence one pass fits in memory (0: no limit)

    @classmethod
    def of(cls, name: str, engine: Any) -> EngineFacts:
        """The facts of a loaded treadle.engine.Engine."""
        return cls(
            name=name,
            vocab_size=int(engine.vocab_size),
            max_seq_len=int(engine.max_seq_len),
            max_lora_rank=int(engine.max_lora_rank),
            arch=engine.arch,
            max_train_tokens=int(getattr(engine, "max_train_tokens", 0)),
        )


@dataclass(frozen=True)
class ReplicaStatus:
    """One worker group of a served model, as `treadle status` shows it."""

    replica: int
    status: str  # serving, restoring, down
    worker_pid: int | None = None  # rank 0's process (None: a thread of the API process)
    device: str | None = None  # what the worker said it runs on (cpu, cuda x4 (nccl, fsdp))
    model_ids: tuple[str, ...] = ()  # the training sessions placed on it
    queue_depth: int = 0  # ops handed to it whose outcome has not come back


class EngineClient(ABC):
    """Submit ops, hear outcomes, ask facts. Every method is safe from the event loop."""

    facts: EngineFacts

    @property
    def name(self) -> str:
        return self.facts.name

    @abstractmethod
    def start(self) -> None: ...

    @abstractmethod
    def stop(self, timeout_s: float = 10.0) -> None: ...

    # ---- training models and their seq_id order ----
    @abstractmethod
    def add_model(self, model_id: str, next_seq: int = 0) -> None:
        """Open the seq_id queue of a new training model (its create op is seq 0)."""

    @abstractmethod
    def has_model(self, model_id: str) -> bool: ...

    @abstractmethod
    def check_seq(self, model_id: str, seq_id: int) -> None:
        """InvalidRequestError if seq_id ran already or is queued; NotFoundError if the model
        is not loaded; EngineDeadError if the engine is gone."""

    @abstractmethod
    def submit(self, op: Op) -> None:
        """Queue an op; its Outcome reaches the on_outcomes callback (never raises). A
        sample op with `stream` set also reports its tokens to on_progress as they come."""

    # ---- samplers (engine ids of frozen weights) ----
    @abstractmethod
    def is_live(self, ref: str) -> bool:
        """Whether a sampler's engine id (a snapshot or a loaded checkpoint) is in memory."""

    def unrestorable(self, model_id: str) -> str | None:
        """Why a model must not be restored here (replaying its op log kept faulting the
        engine: treadle.server.runtime.faults), or None."""
        return None

    @abstractmethod
    async def load_sampler(self, ref: str, checkpoint_type: str, directory: str) -> None:
        """Load a saved checkpoint as sampler weights under `ref`."""

    @abstractmethod
    async def drop_ref(self, ref: str) -> None: ...

    @abstractmethod
    async def check_adapter(self, directory: str) -> None:
        """InvalidRequestError unless the folder is a PEFT adapter this model can load (a
        dry run: loaded, then freed)."""

    @abstractmethod
    async def unload_model(self, model_id: str, reason: str) -> None:
        """Fail the model's queued ops with `reason`, then free its adapter and snapshots."""

    # ---- durability ----
    @abstractmethod
    async def restore_model(
        self, model_id: str, state_dir: str | None, samplers: dict[str, str], next_seq: int
    ) -> None:
        """Load a model's last state snapshot (None: none yet) and its sampler snapshots;
        its queue then expects `next_seq` (the replayed ops follow through `submit`)."""

    @abstractmethod
    async def snapshot_all(self) -> None:
        """Write every changed model's state now (a clean shutdown)."""

    def status(self) -> str:
        """serving, or what keeps it from serving (the console's overview)."""
        return "serving"

    def replicas_status(self) -> list[ReplicaStatus]:
        """Each worker group of this model (one for an engine on a thread)."""
        return [ReplicaStatus(0, self.status())]

    def unfinished(self) -> list[Op]:
        """Ops handed to this engine that it will still run after a restart of its own
        (a worker process keeps them on the API side and sends them again)."""
        return []


class NamedControls(EngineClient):
    """An engine whose control calls run where the engine lives, as calls by name: on its
    thread (EngineLoop.control) or in its worker process (a CALL message, which the worker
    hands to the same EngineLoop.control). One table of names for both."""

    @abstractmethod
    async def _control(self, name: str, **args: Any) -> Any:
        """Run the named control call on the engine's side; → its value, or raise its error."""

    async def load_sampler(self, ref: str, checkpoint_type: str, directory: str) -> None:
        await self._control(
            "load_sampler", ref=ref, checkpoint_type=checkpoint_type, directory=directory
        )

    async def drop_ref(self, ref: str) -> None:
        await self._control("drop_ref", ref=ref)

    async def check_adapter(self, directory: str) -> None:
        await self._control("check_adapter", directory=directory)

    async def unload_model(self, model_id: str, reason: str) -> None:
        await self._control("unload_model", model_id=model_id, reason=reason)

    async def restore_model(
        self, model_id: str, state_dir: str | None, samplers: dict[str, str], next_seq: int
    ) -> None:
        await self._control(
            "restore_model",
            model_id=model_id,
            state_dir=state_dir,
            samplers=samplers,
            next_seq=next_seq,
        )

    async def snapshot_all(self) -> None:
        await self._control("snapshot_all")
