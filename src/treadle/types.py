"""Types shared by the server and the SDK: what a training loop builds and what it gets back.

They follow the Tinker SDK 0.38 JSON shapes field for field, so that the same bodies travel
between our server and either client. numpy is the only array library needed; torch tensors
are accepted where a user has them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

LossFnType = Literal[
    "cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce"
]
StopReason = Literal["stop", "length"]
# The model's user_metadata key under which the SDK sends `training_session_name` (the
# managed service's name for a training session): the server names the session after it.
TRAINING_SESSION_NAME = "training_session_name"

# Plain lists in loss_fn_inputs are coerced by key, as the Tinker SDK does.
INT_KEYS = {"target_tokens"}
FLOAT_KEYS = {
    "weights",
    "advantages",
    "logprobs",
    "clip_low_threshold",
    "clip_high_threshold",
    "sequence_ratio_mask",
}


_NP_OF_WIRE = {"int64": np.int64, "float32": np.float32}


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore", arbitrary_types_allowed=True)


# ---- model inputs -------------------------------------------------------------------------


class EncodedTextChunk(_Wire):
    tokens: list[int]
    type: Literal["encoded_text"] = "encoded_text"

    @property
    def length(self) -> int:
        return len(self.tokens)


class ModelInput(_Wire):
    """A token sequence, as a list of chunks (text only for now)."""

    chunks: list[EncodedTextChunk] = Field(default_factory=list)

    @classmethod
    def from_ints(cls, tokens: Sequence[int]) -> ModelInput:
        """A list of ints, a numpy array or anything array-like: one conversion through
        int64, so a list costs what an array does (a validation pass over a list we just
        made of ints would only repeat the check)."""
        ids = np.asarray(tokens, dtype=np.int64)
        if ids.ndim != 1:
            raise ValueError(f"from_ints: a flat sequence of token ids, got shape {ids.shape}")
        chunk = EncodedTextChunk.model_construct(tokens=ids.tolist())
        return cls.model_construct(chunks=[chunk])

    @classmethod
    def empty(cls) -> ModelInput:
        return cls(chunks=[])

    def to_ints(self) -> list[int]:
        return [t for c in self.chunks for t in c.tokens]

    @property
    def length(self) -> int:
        return sum(c.length for c in self.chunks)

    def append(self, chunk: EncodedTextChunk) -> ModelInput:
        return ModelInput(chunks=[*self.chunks, chunk])

    def append_int(self, token: int) -> ModelInput:
        return self.append(EncodedTextChunk(tokens=[int(token)]))


def as_model_input(prompt: ModelInput | Sequence[int]) -> ModelInput:
    return prompt if isinstance(prompt, ModelInput) else ModelInput.from_ints(prompt)


# ---- tensors and data ---------------------------------------------------------------------


class TensorData(_Wire):
    """A dense array as a flat list plus shape; the JSON form of a tensor."""

    data: list[float] | list[int]
    dtype: Literal["float32", "int64"]
    shape: list[int] | None = None

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> TensorData:
        dtype = "int64" if np.issubdtype(array.dtype, np.integer) else "float32"
        flat = array.astype(_NP_OF_WIRE[dtype], copy=False).reshape(-1)
        # tolist of an int64 / float32 array gives Python ints / floats, the field's types:
        # validating them again would cost more than the conversion itself
        return cls.model_construct(data=flat.tolist(), dtype=dtype, shape=list(array.shape))

    @classmethod
    def from_torch(cls, tensor: Any) -> TensorData:
        return cls.from_numpy(tensor.detach().cpu().numpy())

    def to_numpy(self) -> np.ndarray:
        array = np.asarray(self.data, dtype=np.int64 if self.dtype == "int64" else np.float32)
        return array.reshape(self.shape) if self.shape is not None else array

    def to_torch(self) -> Any:
        import torch

        return torch.from_numpy(self.to_numpy())

    def tolist(self) -> list:
        return self.to_numpy().tolist()


def to_tensor_data(key: str, value: Any) -> TensorData:
    """Coerce a list, numpy array or torch tensor to TensorData, choosing the dtype by key."""
    if isinstance(value, TensorData):
        return value
    if isinstance(value, dict):
        return TensorData.model_validate(value)
    if hasattr(value, "detach"):  # torch.Tensor, without importing torch
        value = value.detach().cpu().numpy()
    array = np.asarray(value)  # a list: the one conversion a list needs, as for the tinker SDK
    if key in INT_KEYS:
        array = array.astype(np.int64, copy=False)
    elif key in FLOAT_KEYS:
        array = array.astype(np.float32, copy=False)
    return TensorData.from_numpy(array)


class PromptProvenanceSpan(_Wire):
    """Datum positions that are positions [offset, offset + length) of the prompt of the
    sampling request that returned `sequence_id`."""

    sequence_id: str
    offset: int = 0
    length: int
    type: Literal["prompt"] = "prompt"


class SampledProvenanceSpan(_Wire):
    """Datum positions that are sampled tokens [offset, offset + length) of `sequence_id`."""

    sequence_id: str
    offset: int = 0
    length: int
    type: Literal["sampled"] = "sampled"


ProvenanceSpan = Annotated[
    PromptProvenanceSpan | SampledProvenanceSpan, Field(discriminator="type")
]


class Datum(_Wire):
    """One training example: the input tokens and the loss inputs aligned with them.

    `model_input[i]` predicts `loss_fn_inputs["target_tokens"][i]`. Provenance (needed by
    stable_reinforce): runs of spans that tile model_input and target_tokens in order,
    naming the sampled sequence behind each position; attach it with `with_provenance`.
    """

    model_input: ModelInput
    loss_fn_inputs: dict[str, TensorData]
    model_input_spans: list[ProvenanceSpan] | None = None
    loss_fn_input_spans: list[ProvenanceSpan] | None = None

    def with_provenance(
        self, model_input: Sequence[ProvenanceSpan], loss_fn_inputs: Sequence[ProvenanceSpan]
    ) -> Datum:
        """A copy carrying both span lists; each must tile its field exactly."""
        targets = self.loss_fn_inputs.get("target_tokens")
        n_targets = targets.to_numpy().shape[0] if targets is not None else None
        for name, spans, n in (
            ("model_input", model_input, self.model_input.length),
            ("loss_fn_inputs", loss_fn_inputs, n_targets),
        ):
            total = sum(s.length for s in spans)
            if n is not None and total != n:
                raise ValueError(
                    f"with_provenance {name} spans cover {total} positions but the field has "
                    f"{n}; the runs must tile it exactly"
                )
        return self.model_copy(
            update={
                "model_input_spans": list(model_input),
                "loss_fn_input_spans": list(loss_fn_inputs),
            }
        )

    @field_validator("model_input", mode="before")
    @classmethod
    def _coerce_input(cls, v: Any) -> Any:
        return ModelInput.from_ints(v) if isinstance(v, list | tuple | np.ndarray) else v

    @field_validator("loss_fn_inputs", mode="before")
    @classmethod
    def _coerce_inputs(cls, v: Any) -> Any:
        return {k: to_tensor_data(k, x) for k, x in dict(v).items()}


# ---- configs ------------------------------------------------------------------------------


class AdamParams(_Wire):
    """AdamW, numerically `torch.optim.AdamW`; `grad_clip_norm=0` means no clipping."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


class LoraConfig(_Wire):
    rank: int = 32
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True
    # A Treadle extension; the Tinker protocol has no alpha. None means alpha = 32.
    alpha: float | None = None


class SamplingParams(_Wire):
    """`stop` takes strings or token ids; the stop is kept in the output; `stop=[]` ignores EOS.

    The fields after top_p are Treadle extensions (docs/sampling.md), None where unused so
    that a request without them is the Tinker one: min_p, logit_bias (token id → bias in
    [-100, 100]), OpenAI's presence / frequency penalties, HF's repetition_penalty, and at
    most one constraint on the text: a JSON schema (a dict, or its JSON text), a regular
    expression, or a Lark / GBNF grammar. A sequence sampled with any of them (or with
    temperature, top_k or top_p) also reports `sampling_logprobs`.
    """

    max_tokens: int | None = None
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float | None = None
    logit_bias: dict[int, float] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    json_schema: dict[str, Any] | bool | str | None = None
    regex: str | None = None
    grammar: str | None = None


# ---- results ------------------------------------------------------------------------------


class ForwardBackwardOutput(_Wire):
    loss_fn_output_type: str = "TensorData"
    loss_fn_outputs: list[dict[str, TensorData]]
    metrics: dict[str, float]


class OptimStepResponse(_Wire):
    metrics: dict[str, float] | None = None


class SampledSequence(_Wire):
    stop_reason: StopReason
    tokens: list[int]
    logprobs: list[float] | None = None
    sequence_id: str | None = None
    # per sampled token: its top-K (token_id, logprob), with topk_sample_logprobs=K
    topk_logprobs: list[list[tuple[int, float]]] | None = None
    # per sampled token, its logprob under the distribution it was drawn from (after
    # temperature, filters and controls; 0 for greedy), where that is not the raw policy's
    # (`logprobs`); a Treadle extension
    sampling_logprobs: list[float] | None = None


class SampleResponse(_Wire):
    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None
    # per prompt position: a list of (token_id, logprob), or None for the first position
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None
    # (len(prompt) - 1, K) float32: logprobs of the requested target_prompt_logprobs ids
    target_prompt_logprobs: TensorData | None = None
    # prompt_alt_tokens_k draws per prompt position: ids int64 and logprobs float32, (P-1, K)
    prompt_alt_tokens: tuple[TensorData, TensorData] | None = None
    # leading prompt tokens the server's prefix cache held (not multiplied by num_samples)
    prompt_cache_hit_tokens: int = 0
    type: Literal["sample"] = "sample"


class SaveWeightsResponse(_Wire):
    path: str


class SaveWeightsForSamplerResponse(_Wire):
    path: str | None = None
    sampling_session_id: str | None = None


class LoadWeightsResponse(_Wire):
    path: str | None = None
    model_id: str | None = None


class ModelData(_Wire):
    arch: str | None = None
    model_name: str | None = None
    tokenizer_id: str | None = None


class GetInfoResponse(_Wire):
    model_data: ModelData
    model_id: str
    optimizer_config: dict[str, Any] | None = None
    is_lora: bool | None = True
    lora_rank: int | None = None
    model_name: str | None = None
    type: Literal["get_info"] = "get_info"


class SupportedModel(_Wire):
    model_name: str
    max_context_length: int | None = None
    trainable: bool = True
    sampleable: bool = True


class Checkpoint(_Wire):
    checkpoint_id: str
    checkpoint_type: Literal["training", "sampler", "external"]
    time: str
    tinker_path: str
    size_bytes: int | None = None
    public: bool = False
    user_metadata: dict[str, str] | None = None
    expires_at: str | None = None


class TrainingRun(_Wire):
    training_run_id: str
    base_model: str
    model_owner: str = "local"
    is_lora: bool = True
    lora_rank: int | None = None
    corrupted: bool = False
    last_request_time: str | None = None
    last_checkpoint: Checkpoint | None = None
    last_sampler_checkpoint: Checkpoint | None = None
    user_metadata: dict[str, str] | None = None
