"""forward / forward_backward over the batches of several sessions in one model pass, and
optim_step (AdamW per adapter).

All rows of all batches go through the model together, right-padded to the longest, each
row routed to its session's adapter (AdapterBank.rows). Each batch then gets its own loss;
their sum is backpropagated once, and since an adapter's parameters only touch its own rows,
every adapter receives exactly the gradient of its own batch. Gradients accumulate in the
parameters' .grad until that adapter's optim_step.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from treadle.engine.lora import Adapter, AdapterBank
from treadle.engine.losses import CLIP_DEFAULTS, FLOAT_KEYS, LOSSES, as_int64, validate_batch
from treadle.engine.types import AdamSpec, TrainBatch, TrainResult
from treadle.errors import InvalidRequestError


def forward_backward(
    model: nn.Module,
    bank: AdapterBank,
    batches: list[TrainBatch],
    vocab_size: int,
    max_seq_len: int,
    forward_only: bool = False,
) -> list[TrainResult]:
    """Logprobs and loss of every batch; gradients into each adapter unless forward_only.

    forward_only also accepts snapshot ids; forward_backward needs live adapters.
    """
    for batch in batches:
        validate_batch(batch, vocab_size, max_seq_len)
        if forward_only:
            bank.get(batch.adapter_id)
        else:
            bank.live(batch.adapter_id)
    if not batches:
        return []
    device = next(model.parameters()).device
    lengths = [len(d.tokens) for b in batches for d in b.data]
    n_rows, T = len(lengths), max(lengths)
    ids = np.zeros((n_rows, T), dtype=np.int64)  # (B, T); pads are token 0, masked out below
    row = 0
    for batch in batches:
        for datum in batch.data:
            ids[row, : len(datum.tokens)] = as_int64(datum.tokens)
            row += 1
    input_ids = torch.from_numpy(ids).to(device)  # (B, T)
    attention_mask = None
    if min(lengths) < T:
        # right padding: real tokens never attend to pads (causal), the mask keeps it so for
        # any attention implementation
        mask_np = np.arange(T)[None, :] < np.asarray(lengths)[:, None]  # (B, T)
        attention_mask = torch.from_numpy(mask_np.astype(np.int64)).to(device)
    keys = [b.adapter_id for b in batches for _ in b.data]

    results: list[TrainResult] = []
    total: torch.Tensor | None = None
    with torch.set_grad_enabled(not forward_only), bank.rows(keys):
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        start = 0
        for batch in batches:
            stop = start + len(batch.data)
            loss, outputs = _batch_loss(logits[start:stop], batch, lengths[start:stop])
            results.append(TrainResult(outputs, {"loss:sum": float(loss.detach())}))
            total = loss if total is None else total + loss
            start = stop
    if not forward_only and total is not None and total.requires_grad:
        total.backward()
    return results


def _batch_loss(
    logits: torch.Tensor, batch: TrainBatch, lengths: list[int]
) -> tuple[torch.Tensor, list[dict[str, np.ndarray]]]:
    """Loss (a scalar, summed over tokens) and per-datum logprobs of one session's rows."""
    n, T, V = logits.shape
    device = logits.device
    spec = LOSSES[batch.loss_fn]
    targets_np = [as_int64(d.loss_inputs["target_tokens"]) for d in batch.data]
    top_k = any(t.ndim == 2 for t in targets_np)
    K = max((t.shape[1] for t in targets_np if t.ndim == 2), default=1)
    tail = (K,) if top_k else ()

    def pad(values: list[np.ndarray], dtype: type) -> torch.Tensor:
        out = np.zeros((n, T, *tail), dtype=dtype)  # (n, T) or (n, T, K)
        for i, v in enumerate(values):
            v = np.asarray(v, dtype=dtype)
            if top_k:
                v = v.reshape(v.shape[0], -1)  # (T_i, K_i): a (T,) datum is K = 1
                out[i, : v.shape[0], : v.shape[1]] = v
            else:
                out[i, : v.shape[0]] = v
        return torch.from_numpy(out).to(device)

    targets = pad(targets_np, np.int64)  # (n, T[, K])
    inputs: dict[str, torch.Tensor] = {}
    for key in FLOAT_KEYS:
        if not any(key in d.loss_inputs for d in batch.data):
            continue
        if key == "weights":
            inputs[key] = pad([d.loss_inputs[key] for d in batch.data], np.float32)
            continue
        # a per-token clip threshold sent for some datums only: the others use the config's
        default = batch.loss_config.get(key, CLIP_DEFAULTS.get(key, 0.0))
        padded = np.zeros((n, T), dtype=np.float32)  # (n, T)
        for i, d in enumerate(batch.data):
            padded[i, : lengths[i]] = d.loss_inputs.get(key, default)
        inputs[key] = torch.from_numpy(padded).to(device)

    logits_f = logits.float()  # (n, T, V): the loss is always computed in fp32
    if top_k:
        lp = logits_f.log_softmax(-1).gather(-1, targets)  # (n, T, K)
    else:
        # cross_entropy fuses log_softmax and the gather: one pass over the vocabulary
        lp = -F.cross_entropy(
            logits_f.reshape(n * T, V), targets.reshape(n * T), reduction="none"
        ).view(n, T)  # (n, T)
    real = torch.arange(T, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]
    if top_k:
        real = real[..., None] & _k_mask(targets_np, n, T, K, device)  # (n, T, K)
    per_token = spec.fn(lp, inputs, batch.loss_config)  # (n, T[, K])
    loss = torch.where(real, per_token, torch.zeros_like(per_token)).sum()

    lp_np = lp.detach().cpu().numpy()
    outputs = []
    for i, t in enumerate(targets_np):
        out = lp_np[i, : t.shape[0], : t.shape[1]] if t.ndim == 2 else lp_np[i, : t.shape[0]]
        if top_k and t.ndim == 1:
            out = lp_np[i, : t.shape[0], 0]
        outputs.append({"logprobs": np.ascontiguousarray(out, dtype=np.float32)})
    return loss, outputs


def _k_mask(targets_np: list[np.ndarray], n: int, T: int, K: int, device) -> torch.Tensor:
    """(n, 1, K) true for the K columns each datum really has."""
    k_each = torch.tensor([t.shape[1] if t.ndim == 2 else 1 for t in targets_np], device=device)
    return (torch.arange(K, device=device)[None, :] < k_each[:, None])[:, None, :]


# ---- optimizer ----
def optim_step(adapter: Adapter, spec: AdamSpec) -> dict[str, float]:
    """One AdamW step on the adapter's accumulated gradients, then zero them.

    torch.optim.AdamW itself, one per adapter, with this step's hyperparameters written into
    its param group: the numbers are torch's. Clipping uses the adapter's total grad norm.
    """
    if not adapter.trainable:
        raise InvalidRequestError(f"{adapter.id!r} is a snapshot; only live adapters train")
    check_adam(spec)
    params = adapter.parameters()
    opt = optimizer_of(adapter, spec)
    grads = [p.grad for p in params if p.grad is not None]
    if spec.grad_clip_norm > 0:
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, spec.grad_clip_norm))
    else:
        grad_norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
    for group in opt.param_groups:
        group["lr"] = spec.learning_rate
        group["betas"] = (spec.beta1, spec.beta2)
        group["eps"] = spec.eps
        group["weight_decay"] = spec.weight_decay
    opt.step()
    opt.zero_grad(set_to_none=True)
    adapter.extra["step"] = adapter.extra.get("step", 0) + 1
    return {"grad_norm:mean": grad_norm, "learning_rate:mean": float(spec.learning_rate)}


def optimizer_of(adapter: Adapter, spec: AdamSpec | None = None) -> torch.optim.AdamW:
    """The adapter's AdamW, created on first use (its state is empty until the first step)."""
    opt = adapter.extra.get("optimizer")
    if opt is None:
        spec = spec or AdamSpec()
        opt = torch.optim.AdamW(
            adapter.parameters(),
            lr=spec.learning_rate,
            betas=(spec.beta1, spec.beta2),
            eps=spec.eps,
            weight_decay=spec.weight_decay,
        )
        adapter.extra["optimizer"] = opt
    return opt


def zero_grad(adapter: Adapter) -> None:
    for p in adapter.parameters():
        p.grad = None


def check_adam(spec: AdamSpec) -> None:
    checks = [
        ("learning_rate", spec.learning_rate, spec.learning_rate >= 0, ">= 0"),
        ("beta1", spec.beta1, 0 <= spec.beta1 < 1, "in [0, 1)"),
        ("beta2", spec.beta2, 0 <= spec.beta2 < 1, "in [0, 1)"),
        ("eps", spec.eps, spec.eps >= 0, ">= 0"),
        ("weight_decay", spec.weight_decay, spec.weight_decay >= 0, ">= 0"),
        ("grad_clip_norm", spec.grad_clip_norm, spec.grad_clip_norm >= 0, ">= 0 (0: no clipping)"),
    ]
    for name, value, ok, expected in checks:
        if not isinstance(value, int | float) or not math.isfinite(value) or not ok:
            raise InvalidRequestError(f"adam_params.{name} must be {expected}, got {value!r}")
