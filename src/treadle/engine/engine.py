"""Engine: one frozen base model, many LoRA adapters, and every op that touches tensors.

It speaks token ids and numpy arrays only. Ids are opaque strings chosen by the caller:
an adapter id per training session, a snapshot id per frozen copy used for sampling.
All methods are synchronous and must be called from one thread (the server's engine loop).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from treadle.engine import checkpoints, optim, train
from treadle.engine.checkpointing import LayerCheckpointing
from treadle.engine.comm import ONE_RANK
from treadle.engine.logprobs import check_head
from treadle.engine.lora import AdapterBank
from treadle.engine.memory import MemoryPlan, MemorySettings, ModelShape
from treadle.engine.models import load_base_model
from treadle.engine.prefix_cache import PrefixCache, cacheable_model
from treadle.engine.threads import threads_for
from treadle.engine.types import (
    AdamSpec,
    LoraSpec,
    SampleRequest,
    SampleResult,
    TrainBatch,
    TrainResult,
)

if TYPE_CHECKING:
    from treadle.engine.sample import DecodeBatch

DEFAULT_PREFIX_CACHE_BYTES = 256 << 20


class Engine:
    def __init__(
        self,
        model_dir: str | Path,
        dtype: str = "float32",
        device: str = "cpu",
        model_name: str | None = None,
        memory: MemorySettings | None = None,
        max_seq_len: int | None = None,
        prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES,
    ):
        """Load an HF causal LM folder (config + safetensors + tokenizer) frozen.

        Attributes set: model, tokenizer, vocab_size, max_seq_len, eos_token_ids, model_dir,
        bank (the AdapterBank that routes rows to adapters; see treadle.engine.lora),
        max_lora_rank (the largest rank create_adapter accepts for a spec that trains every
        layer kind; bank.max_rank(spec) gives it for another spec), memory_plan (the
        memory estimate and budget, treadle.engine.memory), layer_checkpointing and
        max_train_tokens (the longest sequence a forward_backward fits in the budget).
        model_name is what exported adapters name as their base (default: the folder).
        memory: activation checkpointing and the memory budget (default: auto, 90 % of the
        device's memory). max_seq_len: accept sequences this long even past the model's
        context (RoPE positions beyond those it was trained on: they run, with whatever
        quality the model has there); default the model's context. prefix_cache_bytes:
        the sampler's prefix cache across requests (treadle.engine.prefix_cache; 0: off),
        attribute prefix_cache (None when off, or when the model's cache kind cannot be
        kept: prefix_cache_off says why).
        """
        base = load_base_model(model_dir, dtype=dtype, device=device)
        self.base = base
        self.model = base.model
        self.tokenizer = base.tokenizer
        self.vocab_size = base.vocab_size
        self.max_seq_len = max_seq_len or base.max_seq_len
        self.eos_token_ids = base.eos_token_ids
        self.model_dir = base.model_dir
        self.device = base.device
        self.dtype = base.dtype
        self.model_name = model_name or str(model_dir)
        self.bank = AdapterBank(self.model)
        self.max_lora_rank = self.bank.max_rank(LoraSpec())
        check_head(self.model)  # the chunked logprobs are the model's own
        self.layer_checkpointing = LayerCheckpointing(self.model, self.bank)
        self.memory_plan = MemoryPlan(
            ModelShape.of(self.model),
            memory or MemorySettings(),
            self.device,
            can_checkpoint=self.layer_checkpointing.available,
        )
        self.max_train_tokens = self.memory_plan.max_tokens
        self.prefix_cache_off = cacheable_model(self.model) if prefix_cache_bytes > 0 else "off"
        self.prefix_cache = PrefixCache(prefix_cache_bytes) if not self.prefix_cache_off else None

    @property
    def arch(self) -> str | None:
        """The Hugging Face model_type (llama, qwen3, ...)."""
        return getattr(getattr(self.model, "config", None), "model_type", None)

    # ---- adapters ----
    def create_adapter(self, adapter_id: str, spec: LoraSpec) -> None:
        """A fresh adapter (B = 0: it equals the base until its first optim_step)."""
        self.bank.create(adapter_id, spec)

    def drop_adapter(self, adapter_id: str) -> None:
        """Free the adapter, its gradients and optimizer state (its snapshots stay)."""
        self.bank.drop(adapter_id)

    def snapshot(self, adapter_id: str, snapshot_id: str) -> None:
        """Freeze the adapter's current weights under snapshot_id (memory only, no disk I/O)."""
        self.bank.snapshot(adapter_id, snapshot_id)

    def drop_snapshot(self, snapshot_id: str) -> None:
        self.bank.drop_snapshot(snapshot_id)

    def adapter_step(self, adapter_id: str) -> int:
        """How many optim_steps the adapter has taken (restored by load_state)."""
        return int(self.bank.live(adapter_id).extra.get("step", 0))

    # ---- training ----
    def forward_backward(
        self, batches: list[TrainBatch], forward_only: bool = False
    ) -> list[TrainResult]:
        """One model pass over the rows of all batches (several sessions), routed per row
        (several passes when the memory budget asks for it; treadle.engine.train: the path
        of a group too, of which one process is the group of one).

        Gradients accumulate into each adapter until its optim_step.
        Raises InvalidRequestError naming the key and expected shape for bad inputs.
        """
        lengths = [len(d.tokens) for b in batches for d in b.data]
        with threads_for(len(lengths) * max(lengths, default=0)):  # the padded (B, T) fed
            return train.forward_backward(self, ONE_RANK, batches, forward_only)

    def optim_step(self, adapter_id: str, spec: AdamSpec) -> dict[str, float]:
        """AdamW (torch's) on the accumulated gradients; returns grad_norm:mean, learning_rate:mean."""
        return optim.optim_step(self.bank.live(adapter_id), spec)

    # ---- sampling ----
    def sample(self, requests: list[SampleRequest]) -> list[SampleResult]:
        """Decode all requests together (adapters, snapshots or base rows) with a KV cache."""
        from treadle.engine.sample import sample

        return sample(self, requests)

    def decode_batch(self) -> DecodeBatch:
        """An empty incremental decode batch on this engine: add requests to it at any time,
        step it a few tokens at a time (treadle.engine.sample.DecodeBatch)."""
        from treadle.engine.sample import DecodeBatch

        return DecodeBatch(self)

    # ---- checkpoints ----
    def save_adapter(self, adapter_or_snapshot_id: str, out_dir: str | Path) -> None:
        """PEFT format: adapter_config.json + adapter_model.safetensors."""
        adapter = self.bank.get(adapter_or_snapshot_id)
        checkpoints.save_adapter(self.bank, adapter, out_dir, self.model_name)

    def load_adapter(self, adapter_id: str, in_dir: str | Path) -> None:
        """Create adapter_id from a PEFT adapter folder (weights only, fresh optimizer)."""
        spec, weights, scales = checkpoints.read_adapter(in_dir, self.bank)
        self.bank.add(adapter_id, spec, weights, scales)

    def save_merged(self, adapter_or_snapshot_id: str, out_dir: str | Path) -> None:
        """A full HF model folder (weights merged, tokenizer copied) plain transformers loads."""
        adapter = self.bank.get(adapter_or_snapshot_id)
        checkpoints.save_merged(self.model, adapter, out_dir, self.model_dir)

    def save_state(self, adapter_id: str, out_dir: str | Path) -> None:
        """Adapter + AdamW state + step: training continues exactly after load_state."""
        adapter = self.bank.live(adapter_id)
        checkpoints.save_state(self.bank, adapter, out_dir, self.model_name)

    def load_state(self, adapter_id: str, in_dir: str | Path, with_optimizer: bool = True) -> None:
        """Create (or replace) adapter_id from a saved state."""
        checkpoints.load_state(self.bank, adapter_id, in_dir, with_optimizer=with_optimizer)

    def save_snapshot(self, adapter_id: str, out_dir: str | Path) -> None:
        """save_state plus the gradients accumulated since the last optim_step."""
        adapter = self.bank.live(adapter_id)
        checkpoints.save_snapshot(self.bank, adapter, out_dir, self.model_name)

    def load_snapshot(self, adapter_id: str, in_dir: str | Path) -> None:
        """Create (or replace) adapter_id exactly as save_snapshot found it."""
        checkpoints.load_snapshot(self.bank, adapter_id, in_dir)

    def load_frozen(self, snapshot_id: str, in_dir: str | Path) -> None:
        """A snapshot (frozen sampler weights) from a PEFT adapter folder."""
        scratch = f"{snapshot_id}#loading"
        self.load_adapter(scratch, in_dir)
        try:
            self.snapshot(scratch, snapshot_id)
        finally:
            self.drop_adapter(scratch)
