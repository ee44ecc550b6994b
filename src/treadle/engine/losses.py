"""The built-in losses of the Tinker protocol (their inputs are checked by
treadle.engine.specs, the table the server's edge uses too).

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

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from treadle.engine.specs import (
    CLIP_DEFAULTS,
    FLOAT_INPUTS,
    LOSS_SPECS,
    LossSpec,
    validate_train_batch,
)
from treadle.engine.types import TrainBatch

Inputs = dict[str, torch.Tensor]
LossFn = Callable[[torch.Tensor, Inputs, dict[str, float]], torch.Tensor]

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
class Loss:
    """A loss function and its entry of the shared table (treadle.engine.specs)."""

    fn: LossFn
    spec: LossSpec


_FNS: dict[str, LossFn] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "dro": dro,
}
LOSSES: dict[str, Loss] = {name: Loss(_FNS[name], spec) for name, spec in LOSS_SPECS.items()}
FLOAT_KEYS = FLOAT_INPUTS


def validate_batch(batch: TrainBatch, vocab_size: int, max_seq_len: int) -> None:
    """Raise InvalidRequestError naming the key, the expected and the received value."""
    validate_train_batch(
        batch.data, batch.loss_fn, batch.loss_config, vocab_size, max_seq_len, "datum {i}: "
    )


def as_int64(value: np.ndarray) -> np.ndarray:
    return np.asarray(value).astype(np.int64, copy=False)
