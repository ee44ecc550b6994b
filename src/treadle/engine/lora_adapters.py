"""What an adapter is, and the checks its weights pass before the bank takes them.

LoraPair (one layer's A, B and scale) and Adapter (a live adapter or a frozen snapshot) are
the data every LoRA module shares; which nn.Linear layers LoRA may target
(classify_linear_modules) and how a fresh A starts (init_lora_a) decide how one is built;
tensor_peaks and unsafe_layer refuse weights whose update would not be finite. The bank
that routes rows to these adapters is treadle.engine.lora.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from treadle.engine.types import LoraSpec
from treadle.errors import InvalidRequestError

ATTN, MLP, UNEMBED = "attn", "mlp", "unembed"
_ATTN_PARTS = ("attn", "attention")
_MLP_PARTS = ("mlp", "feed_forward", "ffn")
# linear layers that score experts rather than transform tokens (gate_proj is not one)
_GATE_LEAVES = ("gate", "router")
_UIDS = itertools.count()


@dataclass
class LoraPair:
    """The update of one nn.Linear: W x + scale * B (A x); of a fused expert weight, one
    such update per expert, stacked (treadle.engine.lora_experts)."""

    A: torch.Tensor  # (r, in), or (E, r, in)
    B: torch.Tensor  # (out, r), or (E, out, r)
    scale: float

    @property
    def rank(self) -> int:
        return self.A.shape[-2]


@dataclass
class Adapter:
    """A live adapter (nn.Parameters that train) or a snapshot (detached frozen tensors)."""

    id: str
    spec: LoraSpec
    layers: dict[str, LoraPair]  # module path -> pair, sorted by path
    trainable: bool
    extra: dict = field(default_factory=dict)  # free slot for the trainer (optimizer, step)
    # never shared by two adapter objects, even under one id: the prefix cache's version
    uid: int = field(default_factory=lambda: next(_UIDS), compare=False)

    def parameters(self) -> list[torch.Tensor]:
        """A and B of each module, in module-path order (the order optimizer state uses)."""
        out: list[torch.Tensor] = []
        for pair in self.layers.values():
            out += [pair.A, pair.B]
        return out

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def classify_linear_modules(model: nn.Module) -> dict[str, str]:
    """Module path -> ATTN | MLP | UNEMBED for every nn.Linear LoRA may target.

    Attention and MLP projections are recognised by a parent named like `self_attn` / `mlp`,
    which covers Llama, Qwen, Mistral and Gemma; the unembedding is get_output_embeddings().
    A mixture-of-experts model's routing gates are no targets (its experts' fused weights
    are, see treadle.engine.lora_experts).
    """
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    found: dict[str, str] = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if module is out_emb:
            found[name] = UNEMBED
            continue
        parents, leaf = name.split(".")[:-1], name.rsplit(".", 1)[-1]
        if leaf.endswith(_GATE_LEAVES):  # a MoE gate (Qwen2-MoE's shared_expert_gate) stays frozen
            continue
        if any(any(p in part for p in _ATTN_PARTS) for part in parents):
            found[name] = ATTN
        elif any(any(p in part for p in _MLP_PARTS) for part in parents):
            found[name] = MLP
    return dict(sorted(found.items()))


def init_lora_a(A: torch.Tensor, generator: torch.Generator) -> None:
    """PEFT's default init of lora_A (kaiming-uniform, a=sqrt(5)), from our own generator."""
    nn.init.kaiming_uniform_(A, a=math.sqrt(5), generator=generator)


def tensor_peaks(tensors: list[torch.Tensor]) -> list[float]:
    """max |x| of each tensor, nan or inf where it is not finite: one host sync for all."""
    if not tensors:
        return []
    # abs().amax() propagates NaN and is several times faster here than an inf-norm or isfinite
    return torch.stack([t.detach().abs().amax().float() for t in tensors]).tolist()


def unsafe_layer(layers: dict[str, LoraPair]) -> str | None:
    """The first layer whose A, B or update scale * B A may not be finite (None: all safe).

    Every entry of the update (of every expert) is at most |scale| * rank * max|A| * max|B|;
    keeping that under the adapter dtype's largest value keeps the update and the merged
    weight W + s B A of the single-adapter path finite, not just A and B (after
    learning_rate 1e30 both are still finite, around 1e30, while B A overflows).
    """
    pairs = list(layers.items())
    peaks = tensor_peaks([t for _, pair in pairs for t in (pair.A, pair.B)])
    for i, (path, pair) in enumerate(pairs):
        a, b = peaks[2 * i], peaks[2 * i + 1]
        bound = abs(pair.scale) * pair.rank * a * b
        if not (math.isfinite(bound) and bound <= torch.finfo(pair.A.dtype).max):
            return f"{path}: max |A| {a:.3g}, max |B| {b:.3g}, scale {pair.scale:.3g}"
    return None


def _check_spec(spec: LoraSpec) -> None:
    if not isinstance(spec.rank, int) or spec.rank < 1:
        raise InvalidRequestError(f"lora rank must be an integer >= 1, got {spec.rank!r}")
    if not math.isfinite(spec.alpha) or spec.alpha <= 0:
        raise InvalidRequestError(f"lora alpha must be a finite number > 0, got {spec.alpha!r}")
