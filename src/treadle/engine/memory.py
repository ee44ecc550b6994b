"""How much memory a forward / forward_backward will take, estimated before it runs.

The estimate is built from the model's config (layers, hidden size, MLP width, attention
widths, vocabulary), the tokens of the call (rows x padded length) and whether the decoder
layers are checkpointed (treadle.engine.checkpointing). It counts what dominates at long
lengths, each term linear in the tokens:

- what autograd keeps per token and layer without checkpointing (a Llama-style layer with
  LoRA on its projections: about 8 H + 2 KV + 4 I + 8 r values, counted from the tensors
  torch saves: norms' inputs and outputs, q/k/v after RoPE, the attention output, the
  MLP's gate, up and product);
- with checkpointing, each layer's input (H values) for every layer, plus one layer's
  saved tensors while backward recomputes it; measured, a checkpointed call holds about
  CHECKPOINTED_KEPT x H values per token and layer, and that is what is counted;
- backward's working set: the gradient flowing between layers and one layer's gradients
  (BACKWARD_FACTOR x one layer's saved tensors);
- the logits: at most a few chunks of treadle.engine.logprobs.CHUNK_BYTES, never (B, T, V);
- attention needs no (T, T) tensor: the engine passes no attention mask (rows are right
  padded and attention is causal) and SDPA keeps a logsumexp per query.

It is meant to be on the high side; bench/memory.py measures the real peaks against it
(process RSS, which is what an out-of-memory kill reads).
The budget defaults to 90 % of the device's memory: total RAM on a CPU, the GPU's total
memory on CUDA. A call whose estimate exceeds the budget is split into several passes
(treadle.engine.train); a single sequence too long for any pass is refused with its length
and the limit (`max_tokens`), by the server at its edge and by the engine again.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from treadle.engine.checkpointing import MODES
from treadle.engine.logprobs import CHUNK_BYTES
from treadle.engine.specs import fit_limit

DEFAULT_BUDGET_FRACTION = 0.9
BACKWARD_FACTOR = 2.0  # backward's transient tensors, in units of one layer's saved tensors
# What a checkpointed call holds per token and layer, in units of H values: measured, not
# derived (bench/memory.py, SmolLM2-135M at 8k tokens: 593 KB per token over 30 layers where
# the layer inputs and one recomputed layer count 206 KB). The layer input is 1; the rest is
# what the process keeps between layers (allocator pools, the checkpoint's bookkeeping).
CHECKPOINTED_KEPT = 7.0
LOGIT_CHUNKS = 4  # chunk-sized tensors alive at once (logits, their gradient, the head's)
MAX_TOKENS_CAP = 1 << 24  # the search for max_tokens stops here


@dataclass(frozen=True)
class MemorySettings:
    """How the engine bounds a call's memory (the server's --activation-checkpointing,
    --memory-budget-gb and --checkpoint-above-gb)."""

    checkpointing: str = "auto"
    """off | on | auto: auto checkpoints a training call whose estimated activations
    without checkpointing exceed checkpoint_above_bytes."""
    budget_bytes: int | None = None
    """The memory one engine process may use at a call's peak, weights included (None:
    DEFAULT_BUDGET_FRACTION of the device's memory)."""
    checkpoint_above_bytes: int | None = None
    """auto's threshold (None: a quarter of the budget left after the weights)."""

    def __post_init__(self) -> None:
        if self.checkpointing not in MODES:
            raise ValueError(
                f"activation checkpointing must be one of {list(MODES)}, got {self.checkpointing!r}"
            )
        for name in ("budget_bytes", "checkpoint_above_bytes"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only model that its activations scale with."""

    layers: int
    hidden: int
    mlp: int  # MLP width a token passes through (MoE: experts per token x expert width)
    q_width: int  # heads x head_dim
    kv_width: int  # kv heads x head_dim
    vocab: int
    act_bytes: int  # bytes of one activation value (4 fp32, 2 bf16)
    weight_bytes: int  # the base's parameters and buffers

    @classmethod
    def of(cls, model: nn.Module) -> ModelShape:
        cfg = getattr(model, "config", None)
        cfg = getattr(cfg, "text_config", None) or cfg
        hidden = int(_first(cfg, "hidden_size", "n_embd", "d_model", default=1))
        heads = int(_first(cfg, "num_attention_heads", "n_head", default=1))
        head_dim = int(_first(cfg, "head_dim", default=0) or hidden // max(heads, 1))
        kv_heads = int(_first(cfg, "num_key_value_heads", default=heads) or heads)
        mlp = int(_first(cfg, "intermediate_size", "n_inner", "ffn_dim", default=4 * hidden))
        per_token = _first(cfg, "num_experts_per_tok", "moe_topk", default=0)
        if per_token:  # a routed MoE: the experts a token visits, plus any shared expert
            expert = int(_first(cfg, "moe_intermediate_size", default=0) or mlp)
            shared = int(_first(cfg, "shared_expert_intermediate_size", default=0) or 0)
            mlp = int(per_token) * expert + shared
        out = model.get_output_embeddings()
        vocab = int(out.weight.shape[0]) if out is not None else int(cfg.vocab_size)
        param = next(model.parameters())
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        weights += sum(b.numel() * b.element_size() for b in model.buffers())
        return cls(
            layers=int(_first(cfg, "num_hidden_layers", "n_layer", default=1)),
            hidden=hidden,
            mlp=mlp,
            q_width=heads * head_dim,
            kv_width=kv_heads * head_dim,
            vocab=vocab,
            act_bytes=param.element_size() if param.is_floating_point() else 4,
            weight_bytes=weights,
        )

    def layer_saved(self, lora_rank: int = 32) -> int:
        """Bytes autograd keeps per token for one layer without checkpointing."""
        values = 8 * self.hidden + 2 * self.kv_width + 4 * self.mlp + 8 * lora_rank
        values += max(0, self.q_width - self.hidden)  # attention wider than the residual
        return values * self.act_bytes

    def activations(self, tokens: int, checkpointed: bool, train: bool) -> int:
        """Estimated bytes of a call of `tokens` (rows x padded length) beyond the weights."""
        one = self.layer_saved()
        chunk = min(CHUNK_BYTES, tokens * self.vocab * 4)
        logits = LOGIT_CHUNKS * chunk + tokens * 8  # chunks; (B, T) logprobs and ids
        if not train:  # one layer's tensors at a time, and the final hidden states
            return tokens * (one + 2 * self.hidden * self.act_bytes) + logits
        if checkpointed:
            kept = int(self.layers * CHECKPOINTED_KEPT * self.hidden * self.act_bytes) + one
        else:
            kept = self.layers * one
        return tokens * (kept + int(BACKWARD_FACTOR * one)) + logits


class MemoryPlan:
    """The estimate and the budget of one engine: whether a call checkpoints, how many
    tokens one pass may hold, and the longest sequence the engine takes."""

    def __init__(
        self,
        shape: ModelShape,
        settings: MemorySettings,
        device: torch.device | str = "cpu",
        can_checkpoint: bool = True,
    ):
        if settings.checkpointing == "on" and not can_checkpoint:
            raise ValueError(
                "activation checkpointing on: this model names no decoder layer class "
                "(_no_split_modules), so its layers cannot be checkpointed"
            )
        self.shape = shape
        self.settings = settings
        self.can_checkpoint = can_checkpoint
        self.budget = settings.budget_bytes or default_budget(device)
        room = max(1, self.budget - shape.weight_bytes)
        # never above the room: a call that would not fit unchecked is checkpointed
        self.checkpoint_above = min(settings.checkpoint_above_bytes or room // 4 or 1, room)
        self.max_tokens = self._largest_fitting(train=True)
        self.max_forward_tokens = self._largest_fitting(train=False)

    @property
    def mode(self) -> str:
        return self.settings.checkpointing if self.can_checkpoint else "off"

    def checkpoints(self, tokens: int, train: bool) -> bool:
        """Whether a call of `tokens` checkpoints its decoder layers."""
        if not train or self.mode == "off":
            return False
        if self.mode == "on":
            return True
        return self.shape.activations(tokens, False, True) > self.checkpoint_above

    def peak(self, tokens: int, train: bool) -> int:
        """Estimated peak bytes of the process during a call of `tokens`."""
        act = self.shape.activations(tokens, self.checkpoints(tokens, train), train)
        return self.shape.weight_bytes + act

    def fits(self, tokens: int, train: bool) -> bool:
        return self.peak(tokens, train) <= self.budget

    def _largest_fitting(self, train: bool) -> int:
        """The most tokens one pass may hold (0: not even one)."""
        lo, hi = 0, MAX_TOKENS_CAP
        while lo < hi:  # fits() holds up to some count (auto checkpoints before the room)
            mid = (lo + hi + 1) // 2
            if self.fits(mid, train):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def longest(self, train: bool) -> int:
        """The longest sequence one pass holds: forward_backward's, or forward's."""
        return self.max_tokens if train else self.max_forward_tokens

    def describe(self, train: bool = True) -> str:
        """The limit and what it comes from, for error messages."""
        return fit_limit(self.longest(train), self.budget, self.mode)


def default_budget(device: torch.device | str) -> int:
    """DEFAULT_BUDGET_FRACTION of the device's memory: total RAM on a CPU, total GPU
    memory on CUDA."""
    dev = torch.device(device)
    if dev.type == "cuda":
        total = torch.cuda.mem_get_info(dev)[1]
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(total * DEFAULT_BUDGET_FRACTION)


def _first(cfg: object, *names: str, default: object = None) -> object:
    for name in names:
        value = getattr(cfg, name, None)
        if value is not None:
            return value
    return default
