"""The LoRA layer's autograd functions and the merge rule.

When every row of a call uses one adapter, a layer computes `x W^T + b + scale * B(A x)`
either through the fused _LoraLinear (frozen plain nn.Linear, one dtype), the base call plus
_delta, or one matmul with the merged weight W + scale * B A (_merged_weight) when
merge_is_cheaper says so. A training call whose rows use several adapters runs
_SegmentedLoraLinear, _LoraLinear's arithmetic on each adapter's rows (treadle.engine.
lora_routing; the base call plus _delta per adapter where it does not apply): rows of one
adapter get the same numbers whichever path their call takes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from treadle.engine.lora_adapters import LoraPair

# Rows this short are decoding: a single adapter keeps the low-rank product (merging would
# rebuild W + s B A on every step for a token or two, see merge_is_cheaper).
DECODE_MAX_TOKENS = 8


def merge_is_cheaper(
    n_tokens: int, n_in: int, n_out: int, rank: int, grad_weights: bool, grad_input: bool
) -> bool:
    """Whether `x @ (W + s B A)^T` costs fewer FLOPs than `x W^T + s (x A^T) B^T`.

    Multiply-adds of one layer call over N tokens, io = in*out, lo = rank*(in+out):
    - forward: unmerged N*io + N*lo; merged r*io (B @ A) + N*io;
    - input gradient: N*io both, plus N*lo for the product (dY B, then dH A);
    - A/B gradients: the product needs dY B (if not already done), dY^T H and dH^T x; the
      merged path needs dW = dY^T x (N*io) and then B^T dW, dW A^T (2 r*io).
    Forward only this is N > io / (in+out): a token count, whatever the rank. Training (both
    gradients) it is N * (3 lo - io) > 3 r io: for long batches rank*(in+out) > in*out / 3.
    The merged weight kept for backward is one layer's size, less than the adapter's A, B,
    their gradients and AdamW moments (4 lo) whenever training merges (3 lo > io).
    """
    io, lo = n_in * n_out, rank * (n_in + n_out)
    unmerged = n_tokens * (io + lo)
    merged = rank * io + n_tokens * io
    if grad_input:
        unmerged += n_tokens * (io + rank * n_in)
        merged += n_tokens * io
    if grad_input or grad_weights:
        unmerged += n_tokens * rank * n_out
    if grad_weights:
        unmerged += n_tokens * lo
        merged += n_tokens * io + 2 * rank * io
    return merged < unmerged


def _merged_weight(module: nn.Linear, pair: LoraPair) -> torch.Tensor:
    """W + scale * B @ A as a new tensor (W may be a tied embedding: never written), summed in
    the adapter's dtype, then in the base's dtype for the one matmul. (out, in)

    Not cached under no_grad like the stacked weights: the sampler opens one rows() context
    per prefill, and decode steps never merge, so a cache would only hold a copy of every
    targeted weight until the context ends.
    """
    W = module.weight  # (out, in)
    return torch.addmm(W.to(pair.A.dtype), pair.B, pair.A, alpha=pair.scale).to(W.dtype)


class _LoraLinear(torch.autograd.Function):
    """x W^T + b + scale * (x A^T) B^T for one adapter on a frozen nn.Linear, all of one
    dtype: the base call plus _delta's numbers, in fewer passes over the output.

    The (N, r) product is scaled, not the (N, out) update, and the update is accumulated
    into the base matmul's result by addmm (no separate add). Backward as _LoraDelta's.
    """

    @staticmethod
    def forward(ctx, x, W, b, A, B, scale):
        x2 = x.reshape(-1, x.shape[-1])  # (N, in)
        hs = (x2 @ A.t()).mul_(scale)  # (N, r)
        y = x2 @ W.t() if b is None else torch.addmm(b, x2, W.t())  # (N, out)
        y.addmm_(hs, B.t())
        ctx.save_for_backward(x2, W, A, B, hs)
        ctx.scale, ctx.in_shape = scale, x.shape
        return y.view(*x.shape[:-1], W.shape[0])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x2, W, A, B, hs = ctx.saved_tensors
        need_x, _, need_bias, need_a, need_b, _ = ctx.needs_input_grad
        dy2 = dy.reshape(-1, dy.shape[-1])  # (N, out)
        dx, dA, dB = _lora_grads(dy2, x2, A, B, hs, ctx.scale, need_x, need_a, need_b)
        if need_x:  # summed as autograd sums the base's and _LoraDelta's: the same numbers
            dx = (dy2 @ W).add_(dx).view(ctx.in_shape)  # (..., in)
        db = dy2.sum(0) if need_bias else None
        return dx, None, db, dA, dB, None


class _LoraDelta(torch.autograd.Function):
    """scale * (x A^T) B^T, the (N, r) product scaled, with a backward whose skinny matmuls
    run with their long dimension inner (r x N @ N x out, then transposed): BLAS runs those
    several times faster than the (out x N) @ (N x r) layout autograd picks, which on a
    large unembedding cost more than the rest of the LoRA."""

    @staticmethod
    def forward(ctx, x, A, B, scale):
        x2 = x.reshape(-1, x.shape[-1])  # (N, in)
        hs = (x2 @ A.t()).mul_(scale)  # (N, r)
        ctx.save_for_backward(x2, A, B, hs)
        ctx.scale, ctx.in_shape = scale, x.shape
        return (hs @ B.t()).view(*x.shape[:-1], B.shape[0])  # (..., out)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x2, A, B, hs = ctx.saved_tensors
        need_x, need_a, need_b, _ = ctx.needs_input_grad
        dy2 = dy.reshape(-1, dy.shape[-1])  # (N, out)
        dx, dA, dB = _lora_grads(dy2, x2, A, B, hs, ctx.scale, need_x, need_a, need_b)
        return None if dx is None else dx.view(ctx.in_shape), dA, dB, None


class _SegmentedLoraLinear(torch.autograd.Function):
    """x W^T + b for all rows, plus each segment's own scale * (x A^T) B^T on its rows: the
    rows come cut into contiguous segments of one adapter each (`sizes` rows, `scales[s]`
    None for a segment with no LoRA here, whose rows get nothing added), and every segment's
    update is accumulated into its rows of the one base matmul, as _LoraLinear does.

    Neighbouring segments of equal rows and rank form a run that batched matmuls serve at
    once, on their A and B stacked for the call (64 sessions of one row each: a few matmuls
    per layer, not 64 pairs). What this saves over the base call plus a concatenated delta:
    that path builds an update for every row (an exact zero for base rows), concatenates and
    adds them, and backward concatenates the input gradients again: three extra passes over
    an (N, out) tensor, which on a large unembedding (SmolLM2: 49k outputs per token) cost
    as much as the LoRA. `pairs` holds the A, B of the segments with a LoRA, in order.
    The update is computed in the adapters' dtype: on a bf16 base with fp32 adapters each
    run's rows are cast to fp32, their update summed with the base output in fp32 and cast
    back, the numbers of the base call plus _delta.
    """

    @staticmethod
    def forward(ctx, x, W, b, sizes, scales, *pairs):
        T = x.shape[1]
        x2 = x.reshape(-1, x.shape[-1])  # (N, in), segment by segment
        y = x2 @ W.t() if b is None else torch.addmm(b, x2, W.t())  # (N, out)
        runs = _runs(sizes, scales, pairs, T)
        saved = []
        for run in runs:
            A, B = run.stacks(pairs)  # (k, r, in), (k, out, r)
            xk = _view(x2, run, A.dtype)  # (k, n*T, in)
            hs = torch.bmm(xk, A.transpose(1, 2)).mul_(run.scale(A))  # (k, n*T, r)
            yk = y[run.rows].view(run.k, -1, y.shape[1])  # (k, n*T, out)
            if yk.dtype == A.dtype:
                yk.baddbmm_(hs, B.transpose(1, 2))
            else:  # summed in the adapter's dtype, then cast, as the base call plus _delta
                yk.copy_(torch.baddbmm(yk.to(A.dtype), hs, B.transpose(1, 2)))
            saved += [A, B, hs]
        ctx.save_for_backward(x2, W, *saved)
        ctx.runs, ctx.in_shape = runs, x.shape
        return y.view(*x.shape[:-1], W.shape[0])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x2, W, *saved = ctx.saved_tensors
        need_x, _, need_bias = ctx.needs_input_grad[:3]
        dy2 = dy.reshape(-1, dy.shape[-1])  # (N, out)
        dx = dy2 @ W if need_x else None  # (N, in)
        grads: list[torch.Tensor] = []
        for i, run in enumerate(ctx.runs):
            A, B, hs = saved[3 * i : 3 * i + 3]
            xk, dyk = _view(x2, run, A.dtype), _view(dy2, run, A.dtype)  # (k, n*T, in / out)
            dB = torch.bmm(hs.transpose(1, 2), dyk).transpose(1, 2)  # (k, out, r)
            dh = torch.bmm(dyk, B).mul_(run.scale(A))  # (k, n*T, r)
            dA = torch.bmm(dh.transpose(1, 2), xk)  # (k, r, in)
            if need_x:
                dxk = dx[run.rows].view(run.k, -1, dx.shape[1])  # (k, n*T, in)
                if dxk.dtype == A.dtype:
                    dxk.baddbmm_(dh, A)
                else:
                    dxk.add_(torch.bmm(dh, A).to(dxk.dtype))
            for a, b_ in zip(dA.unbind(), dB.unbind(), strict=True):
                grads += [a, b_.contiguous()]
        db = dy2.sum(0) if need_bias else None
        dx = None if dx is None else dx.view(ctx.in_shape)
        return dx, None, db, None, None, *grads


def _view(t2: torch.Tensor, run: _Run, dtype: torch.dtype) -> torch.Tensor:
    """A run's rows of a flattened (N, d) tensor as (k, n*T, d), in `dtype`."""
    return t2[run.rows].view(run.k, -1, t2.shape[1]).to(dtype)


class _Run(NamedTuple):
    """Neighbouring segments with a LoRA, of equal rows and rank: their rows of the flattened
    input, how many (k), which of `pairs` (first), and their scales."""

    rows: slice
    k: int
    first: int  # index of the run's first segment among those with a LoRA
    scales: tuple[float, ...]

    def stacks(self, pairs: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        As = pairs[2 * self.first : 2 * (self.first + self.k) : 2]
        Bs = pairs[2 * self.first + 1 : 2 * (self.first + self.k) : 2]
        if self.k == 1:  # views, no copy
            return As[0].unsqueeze(0), Bs[0].unsqueeze(0)
        return torch.stack(As), torch.stack(Bs)

    def scale(self, like: torch.Tensor) -> torch.Tensor | float:
        if self.k == 1:
            return self.scales[0]
        return torch.tensor(self.scales, dtype=like.dtype, device=like.device)[:, None, None]


def _runs(sizes, scales, pairs, T) -> list[_Run]:
    """The runs of segments with a LoRA, in row order."""
    runs: list[_Run] = []
    start, k = 0, 0  # k: segments with a LoRA seen so far
    prev: tuple | None = None  # (n, rank) of the run being extended, if it ends at `start`
    for n, scale in zip(sizes, scales, strict=True):
        if scale is None:
            prev = None
        else:
            shape = (n, pairs[2 * k].shape[0])
            if prev == shape:
                last = runs[-1]
                rows = slice(last.rows.start, (start + n) * T)
                runs[-1] = _Run(rows, last.k + 1, last.first, (*last.scales, scale))
            else:
                runs.append(_Run(slice(start * T, (start + n) * T), 1, k, (scale,)))
            prev = shape
            k += 1
        start += n
    return runs


def _lora_grads(dy2, x2, A, B, hs, scale, need_x, need_a, need_b):
    """(dX from the update only, dA, dB) of scale * (x A^T) B^T, each None when not needed."""
    dx = dA = dB = None
    if need_b:
        dB = (hs.t() @ dy2).t().contiguous()  # (out, r)
    if need_a or need_x:
        dh = (B.t() @ dy2.t()).t().mul(scale)  # (N, r)
        if need_a:
            dA = dh.t() @ x2  # (r, in)
        if need_x:
            dx = dh @ A  # (N, in)
    return dx, dA, dB


def _delta(x: torch.Tensor, pair: LoraPair) -> torch.Tensor:
    """scale * B(A x) in the adapter's dtype (PEFT casts the input the same way). The scale
    multiplies the rank-r product, as _LoraLinear does: rows of one adapter get the same
    numbers whether their call takes this path or that one."""
    return _LoraDelta.apply(x.to(pair.A.dtype), pair.A, pair.B, pair.scale)  # (..., out)
