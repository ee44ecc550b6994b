"""LoRA on the routed experts of a mixture-of-experts model: a low-rank update per expert.

transformers 5 keeps a MoE layer's experts as fused 3-D parameters of one module
(`mlp.experts.gate_up_proj`, `down_proj`): (E, out, in), or (E, in, out) where the module's
`is_transposed` is set (gpt-oss). peft's `target_parameters` (lora.ParamWrapper) gives
expert e of such a parameter its own A_e (r, in) and B_e (out, r) and computes with
W_e + scale * B_e A_e; a LoraPair here holds them stacked, A (E, r, in) and B (E, out, r),
with the same scale, so expert e of a token computes W_e x + scale * B_e (A_e x). The
router is never a target: its weights stay the base's.

Routing. The bank replaces the experts module's forward (as it does an nn.Linear's) with
routed_experts, which reads the rows() route: every (token, chosen expert) pair is sorted by
expert, then by the adapter of the token's row; each projection runs each expert's base
matmul once for all of its pairs, then each adapter's update on that adapter's pairs of each
expert only (_ExpertsDelta: one autograd node per projection, forward and backward). A pair
never meets another adapter's weights, and rows without a LoRA there add an exact zero.
The gate (gpt-oss's clamped SwiGLU, or act(gate) * up) is the module's own _apply_gate.

One more isolation detail. Which pairs share an expert's base matmul depends on where the
other rows' tokens are routed (a NaN row routes anywhere). This machine's BLAS sums a row of
a matmul with fewer than MIN_ROWS rows in another order than the same row of a larger one,
so a group that small is padded with zero rows: a row's numbers then do not depend on how
many tokens of the batch chose its expert (checked bit for bit on CPU; GPU kernels pick their
tiling from the shape, so there a row's rounding, never its values, may depend on that).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from treadle.engine.lora_adapters import LoraPair
from treadle.engine.lora_routing import _Route

# the fused expert weights LoRA may target
EXPERT_PARAM_NAMES = ("gate_up_proj", "up_proj", "down_proj")
MIN_ROWS = 4  # see the module docstring


@dataclass(frozen=True)
class ExpertParam:
    """One fused 3-D expert weight that LoRA may target."""

    module: str  # path of the experts module
    name: str  # gate_up_proj | up_proj | down_proj
    num_experts: int
    in_features: int
    out_features: int
    transposed: bool  # stored (E, in, out) rather than (E, out, in)
    position: int  # among the module's parameters, in registration order (peft nests by it)


def find_expert_params(model: nn.Module) -> dict[str, ExpertParam]:
    """Parameter path -> ExpertParam for every fused expert weight of the model.

    An experts module is one that transformers' `use_experts_implementation` describes
    (`num_experts`, `is_transposed`, `has_gate`, `has_bias`): only then is its math known
    well enough to add a per-expert update to it. Experts split across processes (expert
    parallel) are not.
    """
    found: dict[str, ExpertParam] = {}
    for path, module in model.named_modules():
        known = all(hasattr(module, a) for a in ("num_experts", "is_transposed", "has_gate"))
        if not known or getattr(module, "_is_expert_parallel", False):
            continue
        for position, (name, p) in enumerate(module._parameters.items()):
            if name not in EXPERT_PARAM_NAMES or p is None or p.ndim != 3:
                continue
            E, d1, d2 = p.shape
            n_in, n_out = (d1, d2) if module.is_transposed else (d2, d1)
            transposed = bool(module.is_transposed)
            found[f"{path}.{name}"] = ExpertParam(path, name, E, n_in, n_out, transposed, position)
    return dict(sorted(found.items()))


def expert_modules(params: dict[str, ExpertParam]) -> dict[str, list[str]]:
    """Experts module path -> its targetable parameter paths, in registration order."""
    out: dict[str, list[str]] = {}
    for path, p in params.items():
        out.setdefault(p.module, []).append(path)
    for paths in out.values():
        paths.sort(key=lambda q: params[q].position)
    return out


def delta_weight(pair: LoraPair, param: ExpertParam) -> torch.Tensor:
    """scale * B_e A_e of every expert in fp32, laid out as the parameter: (E, out, in), or
    (E, in, out) for a transposed one."""
    delta = torch.bmm(pair.B.detach().float(), pair.A.detach().float()) * pair.scale
    return delta.transpose(1, 2) if param.transposed else delta  # (E, out, in) / (E, in, out)


# ---- peft's layout (ParamWrapper): lora_A (r*E, in), lora_B (out, r*E) ----
def to_peft(pair: LoraPair) -> tuple[torch.Tensor, torch.Tensor]:
    """(lora_A.weight, lora_B.weight) as peft stores them: A's rows expert by expert, B's
    columns rank-major (column j*E + e is B_e[:, j]), which peft reshapes back."""
    A, B = pair.A.detach(), pair.B.detach()  # (E, r, in), (E, out, r)
    E, out, r = B.shape
    return A.reshape(E * r, -1).contiguous(), B.permute(1, 2, 0).reshape(out, r * E).contiguous()


def from_peft(
    lora_a: torch.Tensor, lora_b: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """to_peft's inverse: (A (E, r, in), B (E, out, r))."""
    E = num_experts
    if lora_a.ndim != 2 or lora_b.ndim != 2 or lora_a.shape[0] % E or lora_b.shape[1] % E:
        raise ValueError(
            f"expert lora weights of shapes {tuple(lora_a.shape)}, {tuple(lora_b.shape)} do "
            f"not split into {E} experts"
        )
    r = lora_a.shape[0] // E
    A = lora_a.reshape(E, r, lora_a.shape[1])  # (E, r, in)
    B = lora_b.reshape(lora_b.shape[0], r, E).permute(2, 0, 1)  # (E, out, r)
    # contiguous, as create() makes them: a permuted B would sum its matmuls in another order,
    # and a resumed adapter would drift from the one it was saved from
    return A.contiguous(), B.contiguous()


# ---- the routed forward ----
class _Plan(NamedTuple):
    """Where the sorted (token, expert) pairs of one call lie: each expert's rows, and within
    them each adapter slot's rows."""

    experts: list[tuple[int, int, int]]  # (expert, first row, rows), experts with rows
    spans: list[tuple[int, int, int, int]]  # (expert, slot, first row, rows), rows > 0


def routed_experts(
    module: nn.Module,
    x: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    slot_pairs: list[dict[str, LoraPair | None]],
    token_slots: torch.Tensor | None,
) -> torch.Tensor:
    """The experts' output (N, H) of tokens x (N, H) that chose top_k_index (N, k) with
    top_k_weights (N, k), each token's experts updated by its own adapter: token t's adapter
    is slot token_slots[t] (None: all slot 0), whose pairs slot_pairs[s] maps by parameter
    name (missing or None: no LoRA there)."""
    N, k = top_k_index.shape
    E, n_slots = module.num_experts, len(slot_pairs)
    expert_ids = top_k_index.reshape(-1)  # (S,) with S = N * k
    key = expert_ids
    if n_slots > 1:
        key = expert_ids * n_slots + token_slots.repeat_interleave(k)  # (S,)
    order = torch.argsort(key, stable=True)  # (S,) pairs by expert, then adapter
    counts = torch.bincount(key, minlength=E * n_slots).tolist()  # the one host sync
    experts, spans, row = [], [], 0
    for e in range(E):
        first = row
        for slot in range(n_slots):
            n = counts[e * n_slots + slot]
            if n:
                spans.append((e, slot, row, n))
                row += n
        if row > first:
            experts.append((e, first, row - first))
    plan = _Plan(experts, spans)
    xs = x.index_select(0, order // k)  # (S, H), sorted
    first, second = ("gate_up_proj" if module.has_gate else "up_proj"), "down_proj"
    h = _project(module, first, xs, plan, [p.get(first) for p in slot_pairs])  # (S, 2I)
    h = module._apply_gate(h) if module.has_gate else module.act_fn(h)  # (S, I)
    y = _project(module, second, h, plan, [p.get(second) for p in slot_pairs])  # (S, H)
    if getattr(module, "has_post_expert_norm", False):
        y = module.post_expert_norm(y)
    y = y * top_k_weights.reshape(-1).index_select(0, order)[:, None].to(y.dtype)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    # each token sums its k experts in its own order, whatever the other tokens chose
    return y.index_select(0, inverse).view(N, k, -1).sum(1).to(x.dtype)  # (N, H)


def _project(
    module: nn.Module, name: str, x: torch.Tensor, plan: _Plan, pairs: list[LoraPair | None]
) -> torch.Tensor:
    """Projection `name` of the sorted pairs x (S, in): each expert's base matmul on its
    rows, then each adapter's update on its own rows of each expert (_ExpertsDelta)."""
    W = getattr(module, name)  # (E, in, out) if transposed else (E, out, in)
    bias = getattr(module, f"{name}_bias") if module.has_bias else None
    pieces = []
    for e, first, n in plan.experts:
        xe = x[first : first + n]  # (n, in)
        if n < MIN_ROWS:  # see the module docstring
            xe = torch.cat([xe, xe.new_zeros(MIN_ROWS - n, xe.shape[1])])
        out = (xe @ W[e] if module.is_transposed else F.linear(xe, W[e]))[:n]  # (n, out)
        pieces.append(out if bias is None else out + bias[e])
    base = torch.cat(pieces)  # (S, out)
    used = sorted({slot for _, slot, _, _ in plan.spans if pairs[slot] is not None})
    if not used:
        return base
    index = {slot: i for i, slot in enumerate(used)}
    spans = tuple(
        (e, index[slot], first, n, pairs[slot].scale)
        for e, slot, first, n in plan.spans
        if pairs[slot] is not None
    )
    weights = [t for slot in used for t in (pairs[slot].A, pairs[slot].B)]
    delta = _ExpertsDelta.apply(x, spans, *weights)  # (S, out), in the adapters' dtype
    return (base + delta).to(base.dtype)


class _ExpertsDelta(torch.autograd.Function):
    """scale * B[e] (A[e] x) of every span (expert e, adapter j, rows) of x (S, in), an exact
    zero on rows of no span: (S, out), in the adapters' dtype (x cast to it, as _delta does).
    `weights` holds each adapter's A (E, r, in) and B (E, out, r); a span only ever meets its
    own adapter's. One autograd node for all spans of a projection: a Python loop of small
    matmuls, without an autograd call per span."""

    @staticmethod
    def forward(ctx, x, spans, *weights):
        xd = x.to(weights[0].dtype)  # (S, in)
        out = xd.new_zeros(x.shape[0], weights[1].shape[1])  # (S, out)
        hs = []
        for e, j, first, n, scale in spans:
            A, B = weights[2 * j][e], weights[2 * j + 1][e]  # (r, in), (out, r)
            h = (xd[first : first + n] @ A.t()).mul_(scale)  # (n, r)
            torch.mm(h, B.t(), out=out[first : first + n])
            hs.append(h)
        ctx.save_for_backward(xd, *weights, *hs)
        ctx.spans, ctx.n_weights, ctx.x_dtype = spans, len(weights), x.dtype
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        xd, *rest = ctx.saved_tensors
        weights, hs = rest[: ctx.n_weights], rest[ctx.n_weights :]
        need_x = ctx.needs_input_grad[0]
        dy = dy.to(xd.dtype)  # (S, out)
        dx = torch.zeros_like(xd) if need_x else None  # (S, in)
        grads = [
            torch.zeros_like(w) if ctx.needs_input_grad[2 + i] else None
            for i, w in enumerate(weights)
        ]
        for (e, j, first, n, scale), h in zip(ctx.spans, hs, strict=True):
            A, B = weights[2 * j][e], weights[2 * j + 1][e]  # (r, in), (out, r)
            dyk = dy[first : first + n]  # (n, out)
            if grads[2 * j + 1] is not None:
                grads[2 * j + 1][e] = (h.t() @ dyk).t()  # (out, r)
            dh = (dyk @ B).mul_(scale)  # (n, r)
            if grads[2 * j] is not None:
                grads[2 * j][e] = dh.t() @ xd[first : first + n]  # (r, in)
            if need_x:
                torch.mm(dh, A, out=dx[first : first + n])  # (n, in)
        dx = None if dx is None else dx.to(ctx.x_dtype)
        return dx, None, *grads


def expert_route(
    route: _Route, module_path: str, x: torch.Tensor
) -> tuple[list[dict[str, LoraPair | None]], torch.Tensor | None]:
    """(slot_pairs, token_slots) of routed_experts for one experts module called on tokens
    x (N, H): the route's adapters (one slot for a call of one adapter or of the base alone)
    and, for a mixed call, the slot of each token (the batch's rows, flattened row-major)."""
    n_tokens = x.shape[0]

    def pairs(adapter) -> dict[str, LoraPair | None]:
        if adapter is None:
            return {}
        return {n: adapter.layers.get(f"{module_path}.{n}") for n in EXPERT_PARAM_NAMES}

    if n_tokens % route.n_rows:
        raise RuntimeError(
            f"{module_path}: {n_tokens} tokens do not split into the {route.n_rows} rows "
            "that rows() routed"
        )
    if route.whole is not None or not route.segments:
        return [pairs(route.whole)], None
    slots = route.cache.get(("experts", n_tokens))
    if slots is None:
        per_row = torch.tensor(route.slots, dtype=torch.long, device=x.device)
        slots = per_row.repeat_interleave(n_tokens // route.n_rows)  # (N,)
        route.cache[("experts", n_tokens)] = slots
    return [pairs(adapter) for adapter, _ in route.segments], slots


def install_routed_experts(
    module: nn.Module, path: str, route: Callable[[], _Route | None]
) -> nn.Module:
    """Give an experts module the bank's forward: routed_experts while route() is set (inside
    rows()), its own forward otherwise. An instance-level forward, as the bank's nn.Linear
    forward (AdapterBank._hook); deleting it restores the class's."""
    base_forward = type(module).forward

    def forward(module: nn.Module, x, top_k_index, top_k_weights):
        current = route()
        if current is None:
            return base_forward(module, x, top_k_index, top_k_weights)
        slot_pairs, token_slots = expert_route(current, path, x)
        return routed_experts(module, x, top_k_index, top_k_weights, slot_pairs, token_slots)

    module.forward = types.MethodType(forward, module)
    return module
