"""optim_step: one AdamW step per adapter, refused whole when it would leave the adapter
non-finite, and the adapter's optimizer (made on first use, checked when loaded).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from treadle.engine.lora import Adapter, tensor_peaks, unsafe_layer
from treadle.engine.specs import validate_adam
from treadle.engine.types import AdamSpec
from treadle.errors import InvalidRequestError


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
