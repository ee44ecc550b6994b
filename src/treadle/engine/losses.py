"""The built-in losses of the Tinker protocol (their inputs are checked by
treadle.engine.specs, the table the server's edge uses too).

Notation: lp = learner logprobs of target_tokens, s = loss_inputs["logprobs"] (the sampler's),
A = advantages, r = exp(lp - s), sg = stop-gradient. Every loss is a SUM over tokens (never a
mean):

| loss                | per-token value                                  | config (default)        |
|---------------------|--------------------------------------------------|-------------------------|
| cross_entropy       | -w * lp    (w any real; (T, K) allowed)          |                         |
| importance_sampling | -r * A                                           |                         |
| ppo                 | -min(r * A, clamp(r, lo, hi) * A)                | clip_low/high 0.8 / 1.2 |
| cispo               | -sg(clamp(r, lo, hi)) * lp * A                   | clip_low/high 0.8 / 1.2 |
| dro                 | -(lp * A - beta/2 * (lp - s)^2)                  | beta 0.1                |
| gspo                | -min(g * A, clamp(g, lo, hi) * A)                | clip_low/high 0.8 / 1.2 |
| stable_reinforce    | m * (-sg(min(rho, 1)) * A * lp + k * kl)         | kl_coeff k 0.1          |

Every RL loss also takes an optional per-token `weights` input that multiplies its per-token
value (0 removes the token, e.g. the prompt); without it the values above are unchanged.

gspo (GSPO-token, as Tinker documents it): the sequence ratio is the geometric mean of the
per-token ratios over the positions M that "sequence_ratio_mask" marks (nonzero), and every
token carries its value with the gradient of its own logprob:
g_t = exp(mean_{u in M}(sg(lp_u) - s_u) + lp_t - sg(lp_t)). Without a mask, M is the
positions with a nonzero advantage (the sampled tokens, in the usual layout where prompt
positions carry advantage 0); an empty M gives ratio 1.

stable_reinforce (Treadle's definition; Tinker's loss of that name is in alpha and its exact
objective is not published): REINFORCE on the sampled tokens with a truncated importance
weight and a KL pull towards the sampler, both taken from what the server recorded when the
tokens were sampled (record_stability_info), never from the client: q = "recorded_logprobs",
m = "recorded_mask" (1 on sampled tokens, 0 on prompt positions), rho = exp(lp - q), and
kl = rho - 1 - log(rho), the non-negative estimate of KL(sampler || learner) whose gradient
(rho - 1) vanishes on-policy. The weight min(rho, 1) never amplifies a token the learner has
come to favour over the sampler, which is where off-policy importance weights explode.

Per-token clip thresholds may come as loss_inputs "clip_low_threshold"/"clip_high_threshold"
(shape (T,)); they win over the config. DRO's beta defaults to 0.1: the quadratic term pulls
each token back towards the sampler with strength beta per nat of drift, weak next to
advantages of order 1 while still bounding how far one off-policy batch moves the policy.
stable_reinforce's kl_coeff defaults to 0.1 for the same reason (near on-policy its gradient
is kl_coeff * (lp - q), DRO's with beta = kl_coeff).

A loss function here works on a padded batch of one session: lp (N, T) or (N, T, K), its
inputs padded the same way, and returns the per-token loss; the trainer masks and sums.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from treadle.engine.loss_graph_spec import validate_custom_batch
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
STABLE_KL_COEFF = 0.1
STABLE_RATIO_CAP = 1.0


def cross_entropy(lp: torch.Tensor, x: Inputs, cfg: dict[str, float]) -> torch.Tensor:
    return -lp * x["weights"]  # (N, T) or (N, T, K)


def importance_sampling(lp: torch.Tensor, x: Inputs, cfg: dict[str, float]) -> torch.Tensor:
    ratio = torch.exp(lp - x["logprobs"])  # (N, T)
    return _weighted(-ratio * x["advantages"], x)


def ppo(lp: torch.Tensor, x: Inputs, cfg: dict[str, float]) -> torch.Tensor:
    ratio = torch.exp(lp - x["logprobs"])  # (N, T)
    return _weighted(_clipped_objective(ratio, x, cfg), x)


def cispo(lp: torch.Tensor, x: Inputs, cfg: dict[str, float]) -> torch.Tensor:
    ratio = torch.exp(lp - x["logprobs"])  # (N, T)
    lo, hi = _clip_bounds(x, cfg)
    return _weighted(-torch.clamp(ratio, lo, hi).detach() * lp * x["advantages"], x)


def dro(lp: torch.Tensor, x: Inputs, cfg: dict[str, float]) -> torch.Tensor:
    beta = cfg.get("beta", DRO_BETA)
    per = -(lp * x["advantages"] - 0.5 * beta * (lp - x["logprobs"]) ** 2)  # (N, T)
    return _weighted(per, x)


def gspo(lp: torch.Tensor, x: Inputs, cfg: dict[str, float]) -> torch.Tensor:
    in_ratio = (x["sequence_ratio_mask"] != 0).to(lp.dtype)  # (N, T); pads are 0
    log_ratio = (lp.detach() - x["logprobs"]) * in_ratio  # (N, T)
    seq = log_ratio.sum(-1, keepdim=True) / in_ratio.sum(-1, keepdim=True).clamp(min=1)  # (N, 1)
    ratio = torch.exp(seq + lp - lp.detach())  # (N, T): the sequence's value, lp_t's gradient
    return _weighted(_clipped_objective(ratio, x, cfg), x)


def stable_reinforce(lp: torch.Tensor, x: Inputs, cfg: dict[str, float]) -> torch.Tensor:
    m = x["recorded_mask"]  # (N, T): 1 on sampled tokens
    log_rho = (lp - x["recorded_logprobs"]) * m  # (N, T); 0 off the sampled tokens
    rho = torch.exp(log_rho)
    weight = torch.clamp(rho.detach(), max=STABLE_RATIO_CAP)
    kl = rho - 1 - log_rho  # (N, T), >= 0
    coeff = cfg.get("kl_coeff", STABLE_KL_COEFF)
    return _weighted(m * (-weight * x["advantages"] * lp + coeff * kl), x)


def _clipped_objective(ratio: torch.Tensor, x: Inputs, cfg: dict[str, float]) -> torch.Tensor:
    lo, hi = _clip_bounds(x, cfg)
    adv = x["advantages"]
    return -torch.minimum(ratio * adv, torch.clamp(ratio, lo, hi) * adv)  # (N, T)


def _weighted(per_token: torch.Tensor, x: Inputs) -> torch.Tensor:
    return per_token * x["weights"] if "weights" in x else per_token


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
    "gspo": gspo,
    "stable_reinforce": stable_reinforce,
}
LOSSES: dict[str, Loss] = {name: Loss(_FNS[name], spec) for name, spec in LOSS_SPECS.items()}
FLOAT_KEYS = FLOAT_INPUTS


def validate_batch(batch: TrainBatch, vocab_size: int, max_seq_len: int) -> None:
    """Raise InvalidRequestError naming the key, the expected and the received value; then
    fill the defaults of optional per-token inputs that the loss reads for every datum."""
    if batch.custom is not None:  # an uploaded loss: its declared inputs (loss_graph_spec)
        graph = batch.custom.graph  # type: ignore[attr-defined]
        validate_custom_batch(graph, batch.data, vocab_size, max_seq_len, "datum {i}: ")
        return
    validate_train_batch(
        batch.data,
        batch.loss_fn,
        batch.loss_config,
        vocab_size,
        max_seq_len,
        "datum {i}: ",
        recorded=True,
    )
    fill_defaults(batch)


def fill_defaults(batch: TrainBatch) -> None:
    """`weights` sent for some datums of an RL loss only: the others get 1 (unchanged);
    gspo's `sequence_ratio_mask` where absent: the positions with a nonzero advantage."""
    data = batch.data
    if batch.loss_fn != "cross_entropy" and any("weights" in d.loss_inputs for d in data):
        for d in data:
            if "weights" not in d.loss_inputs:
                d.loss_inputs["weights"] = np.ones(len(d.tokens), np.float32)
    if batch.loss_fn == "gspo":
        for d in data:
            if "sequence_ratio_mask" not in d.loss_inputs:
                adv = np.asarray(d.loss_inputs["advantages"])
                d.loss_inputs["sequence_ratio_mask"] = (adv != 0).astype(np.float32)


def as_int64(value: np.ndarray) -> np.ndarray:
    return np.asarray(value).astype(np.int64, copy=False)
