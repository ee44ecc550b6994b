"""What an engine worker is started with: its model, where it runs, and the engine loop's
settings. The API side makes one from its own settings (treadle.server.engines.supervisor
`worker_config`); `treadle worker` from its flags. The worker needs no database: only the
data folder, where it writes checkpoint files and state snapshots."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from treadle.protocol.facts import SnapshotPolicy

TOKEN_ENV = "TREADLE_WORKER_TOKEN"  # the hub's secret, for workers started elsewhere


@dataclass(frozen=True)
class WorkerConfig:
    name: str  # the served model's name, as clients pass it
    path: str  # its Hugging Face folder or .gguf file
    data_dir: str = "./treadle-data"
    dtype: str = "float32"
    device: str = "cpu"
    shard: str = "none"  # none | fsdp (a worker group's base)
    max_snapshots_per_model: int = 8
    max_sample_batch: int = 64
    max_merge_tokens: int = 65536
    max_parked_ops: int = 1024
    max_parked_bytes: int = 1 << 30
    parked_op_timeout_s: float = 600.0
    durable: bool = True
    snapshot_every_steps: int = 10
    snapshot_every_s: float = 60.0
    drain_timeout_s: float = 30.0
    log_level: str = "info"
    activation_checkpointing: str = "auto"  # off | on | auto (treadle.engine.memory)
    memory_budget_gb: float | None = None  # the engine's peak per call (None: 90 % of the device)
    checkpoint_above_gb: float | None = None  # auto: checkpoint a call above this
    max_context: int | None = None  # sequences past the model's own context, if allowed
    prefix_cache_gb: float = 0.25  # the sampler's prefix cache across requests (0: off)
    otel_endpoint: str | None = None  # OTLP/HTTP traces (treadle.protocol.tracing)
    sampler: str = "torch"  # torch | vllm (treadle.worker.vllm)
    vllm_python: str | None = None
    vllm_max_loras: int = 4
    vllm_max_lora_rank: int = 64
    vllm_kv_cache_gb: float = 1.0
    parity_gate: bool = True
    parity_max_abs: float | None = None

    @property
    def artifacts_dir(self) -> Path:
        return Path(self.data_dir).resolve() / "artifacts"

    @property
    def state_dir(self) -> Path:
        """Where state snapshots go (treadle.server.core.recovery loads them)."""
        return self.artifacts_dir / ".state"

    @property
    def snapshots(self) -> SnapshotPolicy:
        return SnapshotPolicy(self.snapshot_every_steps, self.snapshot_every_s)
