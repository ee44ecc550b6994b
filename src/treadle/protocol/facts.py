"""Facts both sides hold about a served model and its workers: what the API checks requests
against (EngineFacts), when a worker writes a model's state (SnapshotPolicy), what a written
state covers (StateSnapshot), and how a worker group is doing (ReplicaStatus)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
    running: int = 0  # of those, in its engine now (its last heartbeat)
    decode_batch: int = 0  # sample ops in its decode batch (its last heartbeat)
    reason: str | None = None  # why it is down and no worker is coming (its model cannot load)


@dataclass
class StateSnapshot:
    """A model's state on disk after op `seq_id`, and the sampler snapshots of it then in
    memory (engine id → folder): what recovery loads before replaying later ops."""

    model_id: str
    seq_id: int
    dir: str
    samplers: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0  # how long writing it took (the API's snapshot metric)
