"""What the engine accepts, as one torch-free table and three validators that both sides use.

The server checks every request at its edge with these functions (so a bad request gets a
400 naming its field before anything is queued), and the engine checks again with the same
functions before any model work (so nothing reaches the tensors unchecked). One table,
one set of messages: the two can never drift apart.

Bounds: values that cannot be meant are refused, not just non-finite ones. They are
generous on purpose (a real loop stays orders of magnitude inside them):

| value                                   | accepted                          |
|-----------------------------------------|-----------------------------------|
| loss_fn_inputs weights, advantages,     | finite, |x| <= 1e6                |
| logprobs, clip thresholds,              |                                   |
| sequence_ratio_mask                     |                                   |
| loss_fn_config values                   | finite, |x| <= 1e6                |
| loss_fn_config kl_coeff, beta           | >= 0 as well                      |
| adam learning_rate                      | 0 <= lr <= 10                     |
| adam beta1, beta2                       | [0, 1)                            |
| adam eps                                | 0 <= eps <= 1                     |
| adam weight_decay                       | 0 <= wd <= 10                     |
| adam grad_clip_norm                     | finite, >= 0 (0: no clipping)     |
| top-K target columns (distillation)     | K <= 1024                         |
| sampling min_p                          | [0, 1]                            |
| sampling logit_bias                     | <= 1024 token ids, each in [-100, 100] |
| sampling presence / frequency penalty   | [-2, 2] (OpenAI's range)          |
| sampling repetition_penalty             | (0, 10]                           |
| sampling constraint                     | <= 64 KiB; compiles within llguidance's limits |
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from treadle.engine.constraints import check_constraint
from treadle.engine.types import AdamSpec, SampleRequest, SampleSpec, TrainDatum
from treadle.errors import InvalidRequestError

MAX_ABS_LOSS_VALUE = 1e6
MAX_LEARNING_RATE = 10.0
MAX_WEIGHT_DECAY = 10.0
MAX_TOPK_COLUMNS = 1024
CLIP_DEFAULTS = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_ABS_LOGIT_BIAS = 100.0
MAX_ABS_PRESENCE_PENALTY = 2.0  # presence and frequency: OpenAI's range
MAX_REPETITION_PENALTY = 10.0


# The inputs the server adds to a datum of a loss that needs provenance, from the sampled
# sequences its loss_fn_input_spans name (treadle.server.core.sequences): the sampler's
# logprob of each target recorded at sampling time, and 1 where the target is a sampled token
# (0 on prompt positions). Never accepted from a client.
RECORDED = ("recorded_logprobs", "recorded_mask")


@dataclass(frozen=True)
class LossSpec:
    """The loss_fn_inputs a loss needs and may take, and its loss_fn_config keys."""

    required: tuple[str, ...]
    optional: tuple[str, ...] = ()
    config: tuple[str, ...] = ()
    top_k: bool = False  # accepts (T, K) target_tokens
    provenance: bool = False  # needs loss_fn_input_spans; trains on the RECORDED inputs

    @property
    def inputs(self) -> tuple[str, ...]:
        return self.required + self.optional


_RL = ("target_tokens", "logprobs", "advantages")
_CLIP = ("clip_low_threshold", "clip_high_threshold")
# Every RL loss takes an optional per-token `weights` multiplier (0 removes a token).
_W = ("weights",)
LOSS_SPECS: dict[str, LossSpec] = {
    "cross_entropy": LossSpec(("target_tokens", "weights"), top_k=True),
    "importance_sampling": LossSpec(_RL, optional=_W),
    "ppo": LossSpec(_RL, optional=(*_W, *_CLIP), config=_CLIP),
    "cispo": LossSpec(_RL, optional=(*_W, *_CLIP), config=_CLIP),
    "dro": LossSpec(_RL, optional=_W, config=("beta",)),
    "gspo": LossSpec(_RL, optional=(*_W, "sequence_ratio_mask", *_CLIP), config=_CLIP),
    # its logprobs are the sampler's as recorded on the server; a client's are accepted
    # (datums built for the other RL losses carry them) and not used
    "stable_reinforce": LossSpec(
        ("target_tokens", "advantages"),
        optional=(*_W, "logprobs"),
        config=("kl_coeff",),
        provenance=True,
    ),
}
FLOAT_INPUTS = ("weights", "logprobs", "advantages", *_CLIP, "sequence_ratio_mask", *RECORDED)


def loss_spec(loss_fn: str) -> LossSpec:
    spec = LOSS_SPECS.get(loss_fn)
    if spec is None:
        raise InvalidRequestError(
            f"loss_fn: unknown loss {loss_fn!r}; loss_fn must be one of {sorted(LOSS_SPECS)}"
        )
    return spec


# ---- forward / forward_backward ------------------------------------------------------------


def validate_train_batch(
    data: list[TrainDatum],
    loss_fn: str,
    loss_config: dict[str, Any],
    vocab_size: int,
    max_seq_len: int,
    where: str = "data[{i}].",
    recorded: bool = False,
) -> dict[str, float]:
    """Raise InvalidRequestError naming the datum, the key, the expected and the received
    value; → the numeric loss config. `where` prefixes each datum's messages.

    recorded=False (a client's datums): the RECORDED inputs are refused; True (the engine's,
    after the server resolved provenance): a provenance loss needs them."""
    spec = loss_spec(loss_fn)
    config = _validate_config(loss_fn, spec, loss_config)
    if not data:
        raise InvalidRequestError("data must hold at least one datum, got an empty list")
    for i, datum in enumerate(data):
        at = where.format(i=i)
        _validate_datum(datum, loss_fn, spec, vocab_size, max_seq_len, at, recorded)
        if recorded and spec.provenance:
            check_recorded(datum, loss_fn, at)
    return config


def fit_limit(max_tokens: int, budget_bytes: int | None = None, mode: str | None = None) -> str:
    """How a refusal names the memory limit on a sequence's length, and how to raise it."""
    why = ""
    if budget_bytes is not None:
        why = f" ({budget_bytes / (1 << 30):.1f} GiB, activation checkpointing {mode})"
    return (
        f"the limit of {max_tokens} tokens that one forward_backward fits in this server's "
        f"memory budget{why}; raise --memory-budget-gb, turn --activation-checkpointing "
        "on, or send shorter sequences"
    )


def check_fit(
    lengths: list[int], max_tokens: int, limit: str | None = None, where: str = "data[{i}]."
) -> None:
    """Refuse a sequence longer than the longest one a pass fits in memory (max_tokens; 0:
    no limit known), naming its length and the limit (`limit`: fit_limit's text)."""
    if max_tokens <= 0:
        return
    for i, n in enumerate(lengths):
        if n > max_tokens:
            raise InvalidRequestError(
                f"{where.format(i=i)}model_input: length {n} exceeds "
                f"{limit or fit_limit(max_tokens)}"
            )


def _validate_datum(
    datum: TrainDatum,
    loss_fn: str,
    spec: LossSpec,
    vocab: int,
    max_len: int,
    where: str,
    recorded: bool = False,
) -> None:
    tokens = _int_array(datum.tokens, where + "model_input")
    if tokens.ndim != 1 or not 1 <= tokens.shape[0] <= max_len:
        raise InvalidRequestError(
            f"{where}model_input has shape {tokens.shape}, expected (T,) with 1 <= T <= {max_len}"
        )
    check_ids(tokens, vocab, where + "model_input")
    T = tokens.shape[0]
    inputs = datum.loss_inputs
    for key in spec.required:
        if key not in inputs:
            raise InvalidRequestError(
                f"{where}loss_fn_inputs is missing {key!r}: {loss_fn} needs {key!r} "
                f"(required: {list(spec.required)}; got {sorted(inputs)})"
            )
    allowed = spec.inputs + (RECORDED if recorded and spec.provenance else ())
    unknown = sorted(set(inputs) - set(allowed))
    if unknown:
        raise InvalidRequestError(
            f"{where}loss_fn_inputs has unexpected key {unknown[0]!r}; {loss_fn} takes "
            f"{list(spec.inputs)}"
        )
    name = where + "loss_fn_inputs['target_tokens']"
    targets = _int_array(inputs["target_tokens"], name)
    top_k_ok = spec.top_k and targets.ndim == 2 and 1 <= targets.shape[1] <= MAX_TOPK_COLUMNS
    if targets.shape[:1] != (T,) or not (targets.ndim == 1 or top_k_ok):
        expected = f"({T},) or ({T}, K)" if spec.top_k else f"({T},)"
        k_cap = f" (K <= {MAX_TOPK_COLUMNS})" if spec.top_k else ""
        raise InvalidRequestError(
            f"{name} has shape {targets.shape}, expected {expected} to match model_input{k_cap}"
        )
    check_ids(targets, vocab, name)
    for key in allowed:
        if key == "target_tokens" or key not in inputs:
            continue
        expected = targets.shape if key == "weights" else (T,)
        value = np.asarray(inputs[key])
        if value.shape != expected:
            to = "target_tokens" if key == "weights" else "model_input"
            raise InvalidRequestError(
                f"{where}loss_fn_inputs[{key!r}] has shape {value.shape}, expected "
                f"{expected} to match {to}"
            )
        if not np.issubdtype(value.dtype, np.number) or not np.isfinite(value).all():
            raise InvalidRequestError(
                f"{where}loss_fn_inputs[{key!r}] must hold finite numbers, got "
                f"dtype {value.dtype} with non-finite or non-numeric values"
            )
        if value.size and np.abs(value).max() > MAX_ABS_LOSS_VALUE:
            raise InvalidRequestError(
                f"{where}loss_fn_inputs[{key!r}] must lie within ±{MAX_ABS_LOSS_VALUE:g}, "
                f"got {float(np.abs(value).max()):g}"
            )


def _validate_config(name: str, spec: LossSpec, config: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in config.items():
        if key not in spec.config:
            raise InvalidRequestError(
                f"loss_fn_config[{key!r}] is not a setting of {name}; expected keys "
                f"{list(spec.config)}"
            )
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidRequestError(
                f"loss_fn_config[{key!r}] must be a finite number, got {value!r}"
            )
        if not math.isfinite(value) or abs(value) > MAX_ABS_LOSS_VALUE:
            raise InvalidRequestError(
                f"loss_fn_config[{key!r}] must be a finite number within "
                f"±{MAX_ABS_LOSS_VALUE:g}, got {value!r}"
            )
        out[key] = float(value)
    lo = out.get("clip_low_threshold", CLIP_DEFAULTS["clip_low_threshold"])
    hi = out.get("clip_high_threshold", CLIP_DEFAULTS["clip_high_threshold"])
    if "clip_low_threshold" in spec.config and not 0 <= lo <= hi:
        raise InvalidRequestError(
            "loss_fn_config needs 0 <= clip_low_threshold <= clip_high_threshold, got "
            f"{lo} and {hi}"
        )
    for key in ("beta", "kl_coeff"):
        if out.get(key, 0.0) < 0:
            raise InvalidRequestError(f"loss_fn_config[{key!r}] must be >= 0, got {out[key]}")
    return out


def check_recorded(datum: TrainDatum, loss_fn: str, where: str) -> None:
    """The RECORDED inputs of a provenance loss's datum: present, a 0/1 mask, logprobs <= 0,
    and advantages only on sampled tokens (a prompt position has no recorded sampler
    logprob to train against)."""
    inputs = datum.loss_inputs
    for key in RECORDED:
        if key not in inputs:
            raise InvalidRequestError(
                f"{where}loss_fn_inputs is missing {key!r}: {loss_fn} trains on the sampled "
                "sequences its loss_fn_input_spans name (the server adds it)"
            )
    mask = np.asarray(inputs["recorded_mask"])
    if not np.isin(mask, (0.0, 1.0)).all():
        raise InvalidRequestError(f"{where}loss_fn_inputs['recorded_mask'] must hold 0 or 1")
    if (np.asarray(inputs["recorded_logprobs"]) > 0).any():
        raise InvalidRequestError(f"{where}loss_fn_inputs['recorded_logprobs'] must be <= 0")
    adv = np.asarray(inputs["advantages"])
    off = np.flatnonzero((mask == 0) & (adv != 0))
    if off.size:
        t = int(off[0])
        raise InvalidRequestError(
            f"{where}loss_fn_inputs['advantages'][{t}] is {float(adv[t]):g} at a position whose "
            f"target is not a sampled token (its provenance span is a prompt span); {loss_fn} "
            "takes nonzero advantages on sampled tokens only"
        )


def _int_array(value: object, name: str) -> np.ndarray:
    arr = np.asarray(value)
    if arr.dtype.kind in "iu":
        return arr
    if arr.dtype.kind == "f" and np.isfinite(arr).all() and (arr == np.round(arr)).all():
        return arr.astype(np.int64)
    raise InvalidRequestError(f"{name} must hold integer token ids, got dtype {arr.dtype}")


def check_ids(ids: np.ndarray | list[int], vocab_size: int, name: str) -> None:
    """Token ids must lie in [0, vocab_size)."""
    ids = np.asarray(ids)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        bad = ids[(ids < 0) | (ids >= vocab_size)].flat[0]
        raise InvalidRequestError(
            f"{name} holds token id {int(bad)}, expected ids in [0, {vocab_size}) "
            "(it is outside the vocabulary)"
        )


# ---- optim_step --------------------------------------------------------------------------------


def validate_adam(spec: AdamSpec, max_learning_rate: float = MAX_LEARNING_RATE) -> None:
    """The edge refuses learning rates above MAX_LEARNING_RATE; the engine itself takes any
    finite rate (its optim_step refuses a step that would overflow, and changes nothing)."""
    lr_range = ">= 0" if math.isinf(max_learning_rate) else f"in [0, {max_learning_rate:g}]"
    checks = [
        ("learning_rate", spec.learning_rate, 0 <= spec.learning_rate <= max_learning_rate,
         lr_range),
        ("beta1", spec.beta1, 0 <= spec.beta1 < 1, "in [0, 1)"),
        ("beta2", spec.beta2, 0 <= spec.beta2 < 1, "in [0, 1)"),
        ("eps", spec.eps, 0 <= spec.eps <= 1, "in [0, 1]"),
        ("weight_decay", spec.weight_decay, 0 <= spec.weight_decay <= MAX_WEIGHT_DECAY,
         f"in [0, {MAX_WEIGHT_DECAY:g}]"),
        ("grad_clip_norm", spec.grad_clip_norm, spec.grad_clip_norm >= 0, ">= 0 (0: no clipping)"),
    ]  # fmt: skip
    for name, value, ok, expected in checks:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidRequestError(f"adam_params.{name} must be a number, got {value!r}")
        if not math.isfinite(value) or not ok:
            raise InvalidRequestError(f"adam_params.{name} must be {expected}, got {value!r}")


# ---- sample -------------------------------------------------------------------------------------


def validate_sample_request(
    req: SampleRequest, vocab_size: int, max_seq_len: int, where: str = ""
) -> None:
    """Raise InvalidRequestError naming the field (as the wire names it), the expected and
    the received value. `where` prefixes every message (e.g. "requests[3].")."""
    V, sp, P = int(vocab_size), req.params, len(req.prompt)
    if P == 0:
        raise InvalidRequestError(f"{where}prompt must hold at least 1 token, got 0")
    check_ids(req.prompt, V, f"{where}prompt")
    if req.num_samples < 1:
        raise InvalidRequestError(f"{where}num_samples must be >= 1, got {req.num_samples}")
    if not 0 <= sp.max_tokens <= max_seq_len - P:
        raise InvalidRequestError(
            f"{where}sampling_params.max_tokens: expected 0..{max(0, max_seq_len - P)} "
            f"(the model's context {max_seq_len} minus the {P} prompt tokens), "
            f"got {sp.max_tokens}"
        )
    if not (sp.temperature >= 0 and math.isfinite(sp.temperature)):
        raise InvalidRequestError(
            f"{where}sampling_params.temperature must be a finite number >= 0, got {sp.temperature}"
        )
    if not 0 < sp.top_p <= 1:
        raise InvalidRequestError(f"{where}sampling_params.top_p must be in (0, 1], got {sp.top_p}")
    if sp.top_k < -1:
        raise InvalidRequestError(
            f"{where}sampling_params.top_k must be -1 or 0 (off) or a positive count, "
            f"got {sp.top_k}"
        )
    check_ids(sp.stop_tokens, V, f"{where}sampling_params.stop (stop_tokens)")
    if any(not isinstance(s, str) or s == "" for s in sp.stop_strings):
        raise InvalidRequestError(
            f"{where}sampling_params.stop (stop_strings) must be non-empty strings, "
            f"got {sp.stop_strings!r}"
        )
    _validate_controls(sp, V, where + "sampling_params.")
    for name in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
        k = getattr(req, name)
        if not 0 <= k <= min(V, MAX_TOPK_COLUMNS):
            raise InvalidRequestError(
                f"{where}{name} must be in [0, {min(V, MAX_TOPK_COLUMNS)}], got {k}"
            )
    ids = req.target_prompt_ids
    if ids is not None:
        if ids.ndim != 2 or ids.shape[0] != P - 1 or not 1 <= ids.shape[1] <= MAX_TOPK_COLUMNS:
            raise InvalidRequestError(
                f"{where}target_prompt_logprobs must be ({P - 1}, K) (prompt length - 1 rows, "
                f"1 <= K <= {MAX_TOPK_COLUMNS}), got shape {tuple(ids.shape)}"
            )
        if ((ids < -1) | (ids >= V)).any():
            raise InvalidRequestError(
                f"{where}target_prompt_logprobs holds token ids outside the vocabulary "
                f"[0, {V}) (-1 asks for nothing)"
            )


def _validate_controls(sp: SampleSpec, V: int, where: str) -> None:
    """min_p, logit_bias, the penalties and the constraint (sizes first, then values)."""

    def number(name: str, value: object, ok: bool, expected: str) -> None:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidRequestError(f"{where}{name} must be a number, got {value!r}")
        if not (math.isfinite(value) and ok):
            raise InvalidRequestError(f"{where}{name} must be {expected}, got {value!r}")

    number("min_p", sp.min_p, 0 <= sp.min_p <= 1, "in [0, 1]")
    m = MAX_ABS_PRESENCE_PENALTY
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(sp, name)
        number(name, value, -m <= value <= m, f"in [-{m:g}, {m:g}]")
    rp = sp.repetition_penalty
    number("repetition_penalty", rp, 0 < rp <= MAX_REPETITION_PENALTY,
           f"in (0, {MAX_REPETITION_PENALTY:g}] (1: off)")  # fmt: skip
    bias = sp.logit_bias
    if not isinstance(bias, dict):
        raise InvalidRequestError(f"{where}logit_bias must map token ids to numbers")
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidRequestError(
            f"{where}logit_bias has {len(bias)} entries, over the limit of {MAX_LOGIT_BIAS_ENTRIES}"
        )
    for t, b in bias.items():
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < V:
            raise InvalidRequestError(
                f"{where}logit_bias has key {t!r}, expected token ids in [0, {V})"
            )
        a = MAX_ABS_LOGIT_BIAS
        number(f"logit_bias[{t}]", b, -a <= b <= a, f"in [-{a:g}, {a:g}]")
    if sp.constraint is not None:  # named as the wire names it: json_schema, regex, grammar
        check_constraint(sp.constraint, f"{where}{sp.constraint.kind}")
