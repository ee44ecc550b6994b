"""forward / forward_backward over the batches of several sessions in one model pass, and
optim_step (AdamW per adapter).

All rows of all batches go through the model together, right-padded to the longest, each
row routed to its session's adapter (AdapterBank.rows). Each batch then gets its own loss;
the sum of the finite ones is backpropagated once, and since an adapter's parameters only
touch its own rows, every adapter receives exactly the gradient of its own batch. Gradients
accumulate in the parameters' .grad until that adapter's optim_step.

Containment: one tenant's numbers never leak into another's. A batch whose loss or new
gradients are not finite adds nothing to its adapter (its result carries `nonfinite:sum` 1),
and an optim_step that would leave an adapter non-finite is refused and changes nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from treadle.engine.lora import Adapter, AdapterBank, tensor_peaks, unsafe_layer
from treadle.engine.losses import CLIP_DEFAULTS, FLOAT_KEYS, LOSSES, as_int64, validate_batch
from treadle.engine.specs import validate_adam
from treadle.engine.types import AdamSpec, TrainBatch, TrainResult
from treadle.errors import InvalidRequestError

# Metric of every forward / forward_backward result: 1.0 when the batch's loss, or the
# gradients it would add to its adapter (alone or accumulated), were not finite, so that it
# added nothing (forward only: when its loss is not finite); 0.0 otherwise.
NONFINITE = "nonfinite:sum"


def forward_backward(
    model: nn.Module,
    bank: AdapterBank,
    batches: list[TrainBatch],
    vocab_size: int,
    max_seq_len: int,
    forward_only: bool = False,
) -> list[TrainResult]:
    """Logprobs and loss of every batch; gradients into each adapter unless forward_only.

    forward_only also accepts snapshot ids; forward_backward needs live adapters. Metrics:
    `loss:sum` and NONFINITE; a non-finite batch leaves its adapter's gradients as they were
    and the other batches of the call exactly as if it had not been there.
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

    losses: list[torch.Tensor] = []
    outputs: list[list[dict[str, np.ndarray]]] = []
    with torch.set_grad_enabled(not forward_only), bank.rows(keys):
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        start = 0
        for batch in batches:
            stop = start + len(batch.data)
            # one batch takes the logits whole: a slice would cost a (B, T, V) zero-fill and
            # copy in backward
            rows = logits if len(batches) == 1 else logits[start:stop]
            loss, outs = _batch_loss(rows, batch, lengths[start:stop])
            losses.append(loss)
            outputs.append(outs)
            start = stop
    values = torch.stack([loss.detach() for loss in losses]).tolist()  # one host sync
    bad = [not math.isfinite(v) for v in values]
    if not forward_only:
        bad = _accumulate(bank, batches, losses, bad)
    return [
        TrainResult(outs, {"loss:sum": value, NONFINITE: float(b)})
        for outs, value, b in zip(outputs, values, bad, strict=True)
    ]


def _accumulate(
    bank: AdapterBank, batches: list[TrainBatch], losses: list[torch.Tensor], bad: list[bool]
) -> list[bool]:
    """Add each batch's gradients to its adapter's .grad where the result stays finite.

    One backward over the sum of the finite losses, gradients taken fresh (autograd.grad)
    and added per adapter only if every one of them, and every accumulated sum, is finite.
    An adapter with several batches in the call whose sum is not finite has them tried one
    by one, so that only the bad ones are dropped. Returns `bad` with those batches marked.
    """
    bad = list(bad)
    of_adapter: dict[str, list[int]] = {}
    for i, batch in enumerate(batches):
        if not bad[i]:
            of_adapter.setdefault(batch.adapter_id, []).append(i)
    live = [i for ids in of_adapter.values() for i in ids]
    if not live:
        return bad
    objective = losses[live[0]]
    for i in live[1:]:
        objective = objective + losses[i]
    if not objective.requires_grad:
        return bad
    adapters = [bank.live(aid) for aid in of_adapter]
    params = [p for adapter in adapters for p in adapter.parameters()]
    several = any(len(ids) > 1 for ids in of_adapter.values())  # may need a second look
    grads = torch.autograd.grad(objective, params, allow_unused=True, retain_graph=several)
    start = 0
    for adapter, ids in zip(adapters, of_adapter.values(), strict=True):
        n = len(adapter.layers) * 2  # its A and B, in parameters() order
        together, start = grads[start : start + n], start + n
        add_or_blame(
            adapter,
            together,
            ids,
            lambda i, a=adapter: torch.autograd.grad(
                losses[i], a.parameters(), allow_unused=True, retain_graph=True
            ),
            bad,
        )
    return bad


def add_or_blame(
    adapter: Adapter,
    together: tuple[torch.Tensor | None, ...],
    ids: list[int],
    alone: Callable[[int], tuple[torch.Tensor | None, ...]],
    bad: list[bool],
) -> None:
    """Add the summed gradients of an adapter's batches `ids` if the result stays finite;
    if not, find which batches are to blame (each one's own gradients from `alone`), add
    the others and mark those in `bad`."""
    if _add_if_finite(adapter, together):
        return
    if len(ids) == 1:
        bad[ids[0]] = True
        return
    for i in ids:  # rare: find which of the adapter's batches are to blame
        bad[i] = not _add_if_finite(adapter, alone(i))


def _add_if_finite(adapter: Adapter, grads: tuple[torch.Tensor | None, ...]) -> bool:
    """.grad += grads (as .backward() accumulates) unless a result would not be finite."""
    params = adapter.parameters()
    sums = [
        None if g is None else g if p.grad is None else p.grad + g
        for p, g in zip(params, grads, strict=True)
    ]
    if not all(math.isfinite(v) for v in tensor_peaks([t for t in sums if t is not None])):
        return False
    for p, t in zip(params, sums, strict=True):
        if t is not None:
            p.grad = t
    return True


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
    elif logits_f.requires_grad:
        lp = _TargetLogprobs.apply(logits_f.reshape(n * T, V), targets.reshape(n * T)).view(n, T)
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


class _TargetLogprobs(torch.autograd.Function):
    """log_softmax(logits)[target] per row of (M, V) logits, differentiable in the logits.

    What -cross_entropy(reduction="none") gives, in fewer passes over the vocabulary: it
    keeps the logits and their logsumexp (M,) instead of an (M, V) log_softmax, and its
    backward writes -g * softmax in one pass and adds g at the targets, where cross
    entropy's zero-fills an (M, V) gradient, scatters into it and then runs the
    log_softmax backward over both.
    """

    @staticmethod
    def forward(ctx, logits, targets):
        lse = torch.logsumexp(logits, -1)  # (M,)
        ctx.save_for_backward(logits, lse, targets)
        return logits.gather(-1, targets[:, None])[:, 0] - lse  # (M,)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        logits, lse, targets = ctx.saved_tensors
        d = torch.sub(logits, lse[:, None]).exp_().mul_(-g[:, None])  # (M, V): -g softmax
        return d.scatter_add_(-1, targets[:, None], g[:, None]), None


def _k_mask(targets_np: list[np.ndarray], n: int, T: int, K: int, device) -> torch.Tensor:
    """(n, 1, K) true for the K columns each datum really has."""
    k_each = torch.tensor([t.shape[1] if t.ndim == 2 else 1 for t in targets_np], device=device)
    return (torch.arange(K, device=device)[None, :] < k_each[:, None])[:, None, :]


# ---- optimizer ----
def optim_step(adapter: Adapter, spec: AdamSpec) -> dict[str, float]:
    """One AdamW step on the adapter's accumulated gradients, then zero them.

    torch.optim.AdamW itself, one per adapter, with this step's hyperparameters written into
    its param group: the numbers are torch's. Clipping uses the adapter's total grad norm.

    A step that would leave the adapter non-finite raises InvalidRequestError naming the
    cause and leaves the weights, AdamW state and step count exactly as they were:
    - weights or their update s B A not finite (see lora.unsafe_layer) while the moments
      are: the learning rate (or weight decay) is to blame, the accumulated gradients are
      kept, so that a step with a sane learning rate can follow at once;
    - AdamW moments not finite: gradients that are not finite (forward_backward never adds
      such) or whose squares overflow (moments do not depend on the learning rate). Those
      gradients can never give a finite step, so they are dropped and the next
      forward_backward starts afresh.
    """
    if not adapter.trainable:
        raise InvalidRequestError(f"{adapter.id!r} is a snapshot; only live adapters train")
    check_adam(spec)
    params = adapter.parameters()
    grads = [p.grad for p in params if p.grad is not None]
    saved = _Saved.of(adapter, clipping=spec.grad_clip_norm > 0)
    opt = optimizer_of(adapter, spec)
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
    moments = _unsafe_moments(adapter, opt)
    unsafe = moments or unsafe_layer(adapter.layers)
    if unsafe is not None:
        saved.restore(adapter)
        if moments is not None:
            zero_grad(adapter)
            raise InvalidRequestError(
                f"optim_step on {adapter.id!r}: the gradients (grad norm {grad_norm:.4g}) are "
                f"not finite or too large for AdamW, whose moments would not be finite "
                f"({moments}); they were dropped and the adapter is unchanged: scale the "
                "loss down or set grad_clip_norm"
            )
        raise InvalidRequestError(
            f"optim_step on {adapter.id!r} with learning_rate {spec.learning_rate:g} (grad "
            f"norm {grad_norm:.4g}) would make the adapter non-finite ({unsafe}); refused, "
            "the adapter and its gradients are unchanged: step again with a lower "
            "learning_rate"
        )
    opt.zero_grad(set_to_none=True)
    adapter.extra["step"] = adapter.extra.get("step", 0) + 1
    return {"grad_norm:mean": grad_norm, "learning_rate:mean": float(spec.learning_rate)}


def _unsafe_moments(adapter: Adapter, opt: torch.optim.AdamW) -> str | None:
    """'AdamW state of <layer>' for the first layer whose moments are not finite, else None.

    The second moment v = b2 v + (1 - b2) g * g is not finite as soon as a gradient is not,
    or its square overflows, and the first moment only if a gradient is not: checking v
    (and amsgrad's max of it) covers both.
    """
    paths = [path for path in adapter.layers for _ in (0, 1)]  # A and B of each layer
    moments = [
        (path, t)
        for path, p in zip(paths, adapter.parameters(), strict=True)
        for key, t in opt.state.get(p, {}).items()
        if key in ("exp_avg_sq", "max_exp_avg_sq")
    ]
    peaks = tensor_peaks([t for _, t in moments])
    for (path, _), peak in zip(moments, peaks, strict=True):
        if not math.isfinite(peak):
            return f"AdamW state of {path}"
    return None


@dataclass
class _Saved:
    """What an optim_step may change, copied, so that a refused step can be undone exactly."""

    weights: list[torch.Tensor]
    grads: list[torch.Tensor | None] | None  # None: no clipping, the step leaves them alone
    state: dict | None  # per parameter AdamW state, None: no optimizer yet
    groups: list[dict]
    step: int | None

    @classmethod
    def of(cls, adapter: Adapter, clipping: bool) -> _Saved:
        params = adapter.parameters()
        opt = adapter.extra.get("optimizer")
        state, groups = None, []
        if opt is not None:
            state = {
                p: {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()}
                for p in params
                if p in opt.state
            }
            groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
        grads = None
        if clipping:  # clip_grad_norm_ scales them in place
            grads = [None if p.grad is None else p.grad.clone() for p in params]
        weights = [p.detach().clone() for p in params]
        return cls(weights, grads, state, groups, adapter.extra.get("step"))

    def restore(self, adapter: Adapter) -> None:
        params = adapter.parameters()
        with torch.no_grad():
            for p, w in zip(params, self.weights, strict=True):
                p.copy_(w)
        if self.grads is not None:
            for p, g in zip(params, self.grads, strict=True):
                p.grad = g
        if self.state is None:
            adapter.extra.pop("optimizer", None)  # created by the refused step: undo that too
        else:
            opt = adapter.extra["optimizer"]
            for p in params:
                if p in self.state:
                    opt.state[p] = self.state[p]
                else:
                    opt.state.pop(p, None)
            for group, saved in zip(opt.param_groups, self.groups, strict=True):
                group.update(saved)
        if self.step is None:
            adapter.extra.pop("step", None)
        else:
            adapter.extra["step"] = self.step


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


def check_optimizer_state(state: dict, where: str) -> None:
    """Refuse an AdamW state_dict whose moments (or any other tensor) are not finite."""
    for index, entries in state.get("state", {}).items():
        tensors = {k: v for k, v in entries.items() if torch.is_tensor(v) and v.is_floating_point()}
        peaks = tensor_peaks(list(tensors.values()))
        for key, peak in zip(tensors, peaks, strict=True):
            if not math.isfinite(peak):
                raise InvalidRequestError(
                    f"{where}: the optimizer state {key!r} of parameter {index} is not finite "
                    f"(max |x| {peak}); refused"
                )


def zero_grad(adapter: Adapter) -> None:
    for p in adapter.parameters():
        p.grad = None


def check_adam(spec: AdamSpec) -> None:
    """The shared rules (treadle.engine.specs), any finite learning rate allowed here."""
    validate_adam(spec, max_learning_rate=math.inf)
