"""The built-in losses of the Tinker protocol and the validation of their inputs.

Notation: lp = learner logprobs of target_tokens, s = loss_inputs["logprobs"] (the sampler's),
A = advantages, r = exp(lp - s). Every loss is a SUM over tokens (never a mean):

| loss                | per-token value                          | config (default)          |
|---------------------|------------------------------------------|---------------------------|
| cross_entropy       | -w * lp    (w any real; (T, K) allowed)  |                           |
| importance_sampling | -r * A                                   |                           |
| ppo                 | -min(r * A, clamp(r, lo, hi) * A)         | clip_low/high 0.8 / 1.2   |
| cispo               | -sg(clamp(r, lo, hi)) * lp * A            | clip_low/high 0.8 / 1.2   |
| dro                 | -(lp * A - beta/2 * (lp - s)^2)           | beta 0.1                  |

Per-token clip thresholds may come as loss_inputs "clip_low_threshold"/"clip_high_threshold"
(shape (T,)); they win over the config. DRO's beta defaults to 0.1: the quadratic term pulls
each token back towards the sampler with strength beta per nat of drift, weak next to
advantages of order 1 while still bounding how far one off-policy batch moves the policy.

A loss function here works on a padded batch of one session: lp (N, T) or (N, T, K), its
inputs padded the same way, and returns the per-token loss; the trainer masks and sums.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from treadle.engine.types import TrainBatch
from treadle.errors import InvalidRequestError

Inputs = dict[str, torch.Tensor]
LossFn = Callable[[torch.Tensor, Inputs, dict[str, float]], torch.Tensor]

CLIP_DEFAULTS = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
DRO_BETA = 0.1


def cross_entropy(lp: torch.Tensor, x: Inputs, cfg: dict[str, float]) -> torch.Tensor:
    return -lp * x["weights"]  # (N, T) or (N, T, K)


def importance_sampling(lp: torch.Tensor, x: Inputs, cfg: dict[str, float]) -> torch.Tensor:
    ratio = torch.exp(lp - x["logprobs"])  # (N, T)
    return -ratio * x["advantages"]


def ppo(lp: torch.Tensor, x: Inputs, cfg: dict[str, float]) -> torch.Tensor:
    ratio = torch.exp(lp - x["logprobs"])  # (N, T)
    lo, hi = _clip_bounds(x, cfg)
    adv = x["advantages"]
    return -torch.minimum(ratio * adv, torch.clamp(ratio, lo, hi) * adv)


def cispo(lp: torch.Tensor, x: Inputs, cfg: dict[str, float]) -> torch.Tensor:
    ratio = torch.exp(lp - x["logprobs"])  # (N, T)
    lo, hi = _clip_bounds(x, cfg)
    return -torch.clamp(ratio, lo, hi).detach() * lp * x["advantages"]


def dro(lp: torch.Tensor, x: Inputs, cfg: dict[str, float]) -> torch.Tensor:
    beta = cfg.get("beta", DRO_BETA)
    return -(lp * x["advantages"] - 0.5 * beta * (lp - x["logprobs"]) ** 2)  # (N, T)


def _clip_bounds(x: Inputs, cfg: dict[str, float]) -> tuple[torch.Tensor, torch.Tensor]:
    bounds = []
    for key in ("clip_low_threshold", "clip_high_threshold"):
        if key in x:
            bounds.append(x[key])  # (N, T)
        else:
            value = cfg.get(key, CLIP_DEFAULTS[key])
            bounds.append(torch.full_like(x["advantages"], value))  # (N, T)
    return bounds[0], bounds[1]


@dataclass(frozen=True)
class LossSpec:
    fn: LossFn
    required: tuple[str, ...]
    optional: tuple[str, ...] = ()
    config: tuple[str, ...] = ()
    top_k: bool = False  # accepts (T, K) target_tokens


_RL = ("target_tokens", "logprobs", "advantages")
_CLIP = ("clip_low_threshold", "clip_high_threshold")
LOSSES: dict[str, LossSpec] = {
    "cross_entropy": LossSpec(cross_entropy, ("target_tokens", "weights"), top_k=True),
    "importance_sampling": LossSpec(importance_sampling, _RL),
    "ppo": LossSpec(ppo, _RL, optional=_CLIP, config=_CLIP),
    "cispo": LossSpec(cispo, _RL, optional=_CLIP, config=_CLIP),
    "dro": LossSpec(dro, _RL, config=("beta",)),
}
FLOAT_KEYS = ("weights", "logprobs", "advantages", *_CLIP)


def validate_batch(batch: TrainBatch, vocab_size: int, max_seq_len: int) -> None:
    """Raise InvalidRequestError naming the key, the expected and the received value."""
    spec = LOSSES.get(batch.loss_fn)
    if spec is None:
        raise InvalidRequestError(f"loss_fn must be one of {sorted(LOSSES)}, got {batch.loss_fn!r}")
    _validate_config(batch.loss_fn, spec, batch.loss_config)
    if not batch.data:
        raise InvalidRequestError("data must hold at least one datum, got an empty list")
    for i, datum in enumerate(batch.data):
        where = f"datum {i}: "
        tokens = _int_array(datum.tokens, where + "model_input")
        if tokens.ndim != 1 or not 1 <= tokens.shape[0] <= max_seq_len:
            raise InvalidRequestError(
                f"{where}model_input has shape {tokens.shape}, expected (T,) with "
                f"1 <= T <= {max_seq_len}"
            )
        _check_ids(tokens, vocab_size, where + "model_input")
        T = tokens.shape[0]
        inputs = datum.loss_inputs
        for key in spec.required:
            if key not in inputs:
                raise InvalidRequestError(
                    f"{where}loss_fn_inputs is missing {key!r}, which {batch.loss_fn} needs "
                    f"(required: {list(spec.required)}; got {sorted(inputs)})"
                )
        unknown = sorted(set(inputs) - set(spec.required) - set(spec.optional))
        if unknown:
            raise InvalidRequestError(
                f"{where}loss_fn_inputs has unexpected key {unknown[0]!r}; {batch.loss_fn} takes "
                f"{list(spec.required + spec.optional)}"
            )
        targets = _int_array(inputs["target_tokens"], where + "loss_fn_inputs['target_tokens']")
        top_k_ok = spec.top_k and targets.ndim == 2 and targets.shape[1] >= 1
        if targets.shape[:1] != (T,) or not (targets.ndim == 1 or top_k_ok):
            expected = f"({T},) or ({T}, K)" if spec.top_k else f"({T},)"
            raise InvalidRequestError(
                f"{where}loss_fn_inputs['target_tokens'] has shape {targets.shape}, "
                f"expected {expected} to match model_input"
            )
        _check_ids(targets, vocab_size, where + "loss_fn_inputs['target_tokens']")
        for key in (*spec.required, *spec.optional):
            if key == "target_tokens" or key not in inputs:
                continue
            expected = targets.shape if key == "weights" else (T,)
            value = np.asarray(inputs[key])
            if value.shape != expected:
                raise InvalidRequestError(
                    f"{where}loss_fn_inputs[{key!r}] has shape {value.shape}, expected "
                    f"{expected} to match "
                    + ("target_tokens" if key == "weights" else "model_input")
                )
            if not np.issubdtype(value.dtype, np.number) or not np.isfinite(value).all():
                raise InvalidRequestError(
                    f"{where}loss_fn_inputs[{key!r}] must hold finite numbers, got "
                    f"dtype {value.dtype} with non-finite or non-numeric values"
                )


def as_int64(value: np.ndarray) -> np.ndarray:
    return np.asarray(value).astype(np.int64, copy=False)


def _int_array(value: object, name: str) -> np.ndarray:
    arr = np.asarray(value)
    if arr.dtype.kind in "iu":
        return arr
    if arr.dtype.kind == "f" and np.isfinite(arr).all() and (arr == np.round(arr)).all():
        return arr.astype(np.int64)
    raise InvalidRequestError(f"{name} must hold integer token ids, got dtype {arr.dtype}")


def _check_ids(ids: np.ndarray, vocab_size: int, name: str) -> None:
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        bad = ids[(ids < 0) | (ids >= vocab_size)].flat[0]
        raise InvalidRequestError(
            f"{name} holds token id {int(bad)}, expected ids in [0, {vocab_size})"
        )


def _validate_config(name: str, spec: LossSpec, config: dict[str, float]) -> None:
    for key, value in config.items():
        if key not in spec.config:
            raise InvalidRequestError(
                f"loss_fn_config[{key!r}] is not a setting of {name}; expected keys "
                f"{list(spec.config)}"
            )
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise InvalidRequestError(
                f"loss_fn_config[{key!r}] must be a finite number, got {value!r}"
            )
    lo = config.get("clip_low_threshold", CLIP_DEFAULTS["clip_low_threshold"])
    hi = config.get("clip_high_threshold", CLIP_DEFAULTS["clip_high_threshold"])
    if "clip_low_threshold" in spec.config and not 0 <= lo <= hi:
        raise InvalidRequestError(
            "loss_fn_config needs 0 <= clip_low_threshold <= clip_high_threshold, got "
            f"{lo} and {hi}"
        )
    if config.get("beta", 0.0) < 0:
        raise InvalidRequestError(f"loss_fn_config['beta'] must be >= 0, got {config['beta']}")
