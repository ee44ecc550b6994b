"""The engine's own vocabulary: token ids, numpy arrays and plain settings; no HTTP, no DB.

The server translates wire types (treadle.types) into these at its edge.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class LoraSpec:
    """One training session's adapter. alpha/rank scales the update (PEFT's convention)."""

    rank: int = 32
    alpha: float = 32.0
    seed: int = 0
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True


@dataclass
class AdamSpec:
    """AdamW, numerically torch.optim.AdamW; grad_clip_norm 0 disables clipping."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


@dataclass
class TrainDatum:
    """tokens_T[i] predicts loss_inputs["target_tokens"][i]; inputs are (T,) or (T, K)."""

    tokens: np.ndarray  # (T,) int64
    loss_inputs: dict[str, np.ndarray]


@dataclass
class TrainBatch:
    """The data of one session for one forward / forward_backward call."""

    adapter_id: str
    data: list[TrainDatum]
    loss_fn: str = "cross_entropy"
    loss_config: dict[str, float] = field(default_factory=dict)
    # loss_fn "custom": the uploaded loss (treadle.engine.loss_graph.CustomLoss)
    custom: object | None = None


@dataclass
class TrainResult:
    """Per datum outputs (always "logprobs", shaped like target_tokens) and `name:reduction` metrics."""

    outputs: list[dict[str, np.ndarray]]
    metrics: dict[str, float]


@dataclass
class Constraint:
    """What a row's text must match (treadle.engine.constraints compiles it with llguidance):
    kind "json_schema" (source: the schema as JSON text; OpenAI's json_object mode is the
    schema {"type": "object"}), "regex", or "grammar" (a Lark or GBNF grammar)."""

    kind: str
    source: str


@dataclass
class SampleSpec:
    """temperature 0 is greedy (the argmax of the logits after the controls). The controls
    (treadle.engine.sample_controls) act in this order on the raw logits: the constraint's
    mask, logit_bias, repetition_penalty, presence/frequency penalties; then temperature,
    min_p, top_k, top_p."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop_strings: list[str] = field(default_factory=list)
    stop_tokens: list[int] = field(default_factory=list)
    stop_at_eos: bool = True
    min_p: float = 0.0  # drop tokens below min_p x the top token's probability (0: off)
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    presence_penalty: float = 0.0  # OpenAI's, over the sampled tokens
    frequency_penalty: float = 0.0  # OpenAI's, over the sampled tokens
    repetition_penalty: float = 1.0  # HF's (CTRL), over the prompt and the sampled tokens
    constraint: Constraint | None = None

    @property
    def has_controls(self) -> bool:
        """Whether a control beyond temperature / top-k / top-p / min-p acts on the logits."""
        return bool(
            self.logit_bias
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.constraint is not None
        )

    @property
    def shapes(self) -> bool:
        """Whether tokens are drawn from another distribution than the raw softmax (then a
        sampled sequence reports sampling_logprobs as well)."""
        return (
            self.has_controls
            or self.temperature != 1.0
            or self.top_k > 0
            or self.top_p < 1.0
            or self.min_p > 0.0
        )


@dataclass
class SampleRequest:
    """`adapter` is a live adapter id, a snapshot id, or None for the base model."""

    prompt: list[int]
    num_samples: int = 1
    params: SampleSpec = field(default_factory=SampleSpec)
    adapter: str | None = None
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    # (P-1, K) int64: row i names the tokens to score at prompt position i + 1; -1 = none
    target_prompt_ids: np.ndarray | None = None
    topk_sample_logprobs: int = 0  # the top K at every sampled position
    prompt_alt_tokens_k: int = 0  # K draws at the request's temperature per prompt position
    # rows share cached prompt prefixes only within one scope (the server: the tenant)
    prefix_scope: str = ""


@dataclass
class SampledSeq:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" | "length"
    # per sampled token, its top-K (token_id, logprob), with topk_sample_logprobs = K
    topk: list[list[tuple[int, float]]] | None = None
    # per sampled token, its logprob under the distribution it was drawn from (after the
    # controls, temperature and filters; 0 for greedy): only where that is not the raw one
    sampling_logprobs: list[float] | None = None


@dataclass
class SampleResult:
    sequences: list[SampledSeq]
    # one entry per prompt position; the first is None (nothing predicts it)
    prompt_logprobs: list[float | None] | None = None
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None
    target_prompt_logprobs: np.ndarray | None = None  # (P-1, K) fp32, 0 where the id was -1
    prompt_alt_tokens: tuple[np.ndarray, np.ndarray] | None = None  # ids, logprobs: (P-1, K)
    prompt_cache_hit_tokens: int = 0  # leading prompt tokens the prefix cache held
