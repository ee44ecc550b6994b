"""Engine: one frozen base model, many LoRA adapters, and every op that touches tensors.

It speaks token ids and numpy arrays only. Ids are opaque strings chosen by the caller:
an adapter id per training session, a snapshot id per frozen copy used for sampling.
All methods are synchronous and must be called from one thread (the server's engine loop).
"""

from __future__ import annotations

from pathlib import Path

from treadle.engine.types import (
    AdamSpec,
    LoraSpec,
    SampleRequest,
    SampleResult,
    TrainBatch,
    TrainResult,
)


class Engine:
    def __init__(self, model_dir: str | Path, dtype: str = "float32", device: str = "cpu"):
        """Load an HF causal LM folder (config + safetensors + tokenizer) frozen.

        Attributes set: model, tokenizer, vocab_size, max_seq_len, eos_token_ids, model_dir.
        """
        raise NotImplementedError

    # ---- adapters ----
    def create_adapter(self, adapter_id: str, spec: LoraSpec) -> None:
        raise NotImplementedError

    def drop_adapter(self, adapter_id: str) -> None:
        """Free the adapter, its gradients and optimizer state (its snapshots stay)."""
        raise NotImplementedError

    def snapshot(self, adapter_id: str, snapshot_id: str) -> None:
        """Freeze the adapter's current weights under snapshot_id (memory only, no disk I/O)."""
        raise NotImplementedError

    def drop_snapshot(self, snapshot_id: str) -> None:
        raise NotImplementedError

    # ---- training ----
    def forward_backward(
        self, batches: list[TrainBatch], forward_only: bool = False
    ) -> list[TrainResult]:
        """One model pass over the rows of all batches (several sessions), routed per row.

        Gradients accumulate into each adapter until its optim_step.
        Raises InvalidRequestError naming the key and expected shape for bad inputs.
        """
        raise NotImplementedError

    def optim_step(self, adapter_id: str, spec: AdamSpec) -> dict[str, float]:
        raise NotImplementedError

    # ---- sampling ----
    def sample(self, requests: list[SampleRequest]) -> list[SampleResult]:
        """Decode all requests together (adapters, snapshots or base rows) with a KV cache."""
        raise NotImplementedError

    # ---- checkpoints ----
    def save_adapter(self, adapter_or_snapshot_id: str, out_dir: str | Path) -> None:
        """PEFT format: adapter_config.json + adapter_model.safetensors."""
        raise NotImplementedError

    def load_adapter(self, adapter_id: str, in_dir: str | Path) -> None:
        """Create adapter_id from a PEFT adapter folder (weights only, fresh optimizer)."""
        raise NotImplementedError

    def save_merged(self, adapter_or_snapshot_id: str, out_dir: str | Path) -> None:
        """A full HF model folder (weights merged, tokenizer copied) plain transformers loads."""
        raise NotImplementedError

    def save_state(self, adapter_id: str, out_dir: str | Path) -> None:
        """Adapter + AdamW state + step: training continues exactly after load_state."""
        raise NotImplementedError

    def load_state(self, adapter_id: str, in_dir: str | Path, with_optimizer: bool = True) -> None:
        """Create (or replace) adapter_id from a saved state."""
        raise NotImplementedError
