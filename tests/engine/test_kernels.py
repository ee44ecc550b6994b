"""The training path's own autograd functions against the plain torch expressions they
replace: values and every gradient (float64 gradcheck, and float32 against autograd).

    .venv/bin/python -m pytest -q tests/engine/test_kernels.py
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from treadle.engine.logprobs import TargetLogprobs
from treadle.engine.lora import _LoraDelta, _LoraLinear
from treadle.engine.lora_kernels import _SegmentedLoraLinear


def _inputs(dtype, bias: bool, x_grad: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 5, 6, generator=gen, dtype=dtype).requires_grad_(x_grad)  # (B, T, in)
    W = torch.randn(7, 6, generator=gen, dtype=dtype)  # (out, in), frozen
    b = torch.randn(7, generator=gen, dtype=dtype).requires_grad_(True) if bias else None
    A = torch.randn(3, 6, generator=gen, dtype=dtype).requires_grad_(True)  # (r, in)
    B = torch.randn(7, 3, generator=gen, dtype=dtype).requires_grad_(True)  # (out, r)
    return x, W, b, A, B


def _reference(x, W, b, A, B, scale):
    return F.linear(x, W, b) + F.linear(F.linear(x, A), B) * scale


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("x_grad", [False, True])
def test_lora_linear_gradcheck(bias, x_grad):
    x, W, b, A, B = _inputs(torch.float64, bias, x_grad)
    assert torch.autograd.gradcheck(lambda *t: _LoraLinear.apply(*t), (x, W, b, A, B, 0.5))
    assert torch.autograd.gradcheck(lambda *t: _LoraDelta.apply(*t), (x, A, B, 2.0))


@pytest.mark.parametrize("bias", [False, True])
def test_lora_linear_equals_the_plain_expression(bias):
    x, W, b, A, B = _inputs(torch.float32, bias, x_grad=True, seed=1)
    g = torch.randn(2, 5, 7)
    leaves = [t for t in (x, b, A, B) if t is not None]
    want = _reference(x, W, b, A, B, 4.0)
    want_grads = torch.autograd.grad(want, leaves, g)
    for fn in (
        lambda: _LoraLinear.apply(x, W, b, A, B, 4.0),
        lambda: F.linear(x, W, b) + _LoraDelta.apply(x, A, B, 4.0),
    ):
        got = fn()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for a, e in zip(torch.autograd.grad(got, leaves, g), want_grads, strict=True):
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


def test_a_fresh_adapter_adds_an_exact_zero():
    x, W, _, A, B = _inputs(torch.float32, bias=False, x_grad=False)
    with torch.no_grad():
        B.zero_()
    assert torch.equal(_LoraLinear.apply(x, W, None, A, B, 4.0), F.linear(x, W))


# (rows, rank, scale) of each segment, rank None for rows without a LoRA here
LAYOUTS = {
    "segments": [(2, 3, 0.5), (1, None, None), (1, 2, 2.0)],
    # neighbours of equal rows and rank form runs that batched matmuls serve
    "runs": [(1, 3, 0.5), (1, 3, 2.0), (1, 3, 1.0), (1, None, None), (2, 2, 1.5), (2, 2, 3.0)],
}


def _segments(dtype, bias: bool, layout: str, seed: int = 3):
    """x (B, 5, 6), W (7, 6), b, the segments' sizes and scales, and their A, B in order."""
    segs = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(n for n, _, _ in segs), 5, 6, generator=gen, dtype=dtype)
    W = torch.randn(7, 6, generator=gen, dtype=dtype)
    b = torch.randn(7, generator=gen, dtype=dtype).requires_grad_(True) if bias else None
    pairs = [
        torch.randn(*shape, generator=gen, dtype=dtype).requires_grad_(True)
        for _, r, _ in segs
        if r is not None
        for shape in ((r, 6), (7, r))
    ]
    sizes, scales = tuple(n for n, _, _ in segs), tuple(s for _, _, s in segs)
    return x.requires_grad_(True), W, b, sizes, scales, pairs


def _each_rows_own(x, W, b, sizes, scales, pairs):
    """Each segment through its own plain expression (the base alone for rows without)."""
    out, start, it = [], 0, iter(pairs)
    for n, scale in zip(sizes, scales, strict=True):
        rows = x[start : start + n]
        out.append(
            F.linear(rows, W, b)
            if scale is None
            else _reference(rows, W, b, *[next(it), next(it)], scale)
        )
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("bias", [False, True])
def test_segmented_lora_linear_gradcheck(bias, layout):
    x, W, b, sizes, scales, pairs = _segments(torch.float64, bias, layout)
    fn = lambda x, b, *p: _SegmentedLoraLinear.apply(x, W, b, sizes, scales, *p)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, b, *pairs))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("bias", [False, True])
def test_segmented_lora_linear_equals_each_rows_own_expression(bias, layout):
    x, W, b, sizes, scales, pairs = _segments(torch.float32, bias, layout, seed=4)
    g = torch.randn(x.shape[0], 5, 7)
    leaves = [t for t in (x, b, *pairs) if t is not None]
    got = _SegmentedLoraLinear.apply(x, W, b, sizes, scales, *pairs)
    want = _each_rows_own(x, W, b, sizes, scales, pairs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    grads = zip(
        torch.autograd.grad(got, leaves, g), torch.autograd.grad(want, leaves, g), strict=True
    )
    for a, e in grads:
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_segmented_lora_linear_keeps_a_bad_adapter_to_its_rows(layout):
    """A NaN adapter (the first): its rows are NaN, forward and backward; every other row,
    and every other adapter's gradients, are exactly what they are without it, also when
    it shares a run's stacked weights."""
    x, W, _, sizes, scales, pairs = _segments(torch.float32, False, layout, seed=5)
    g = torch.randn(x.shape[0], 5, 7)
    n = sizes[0]
    clean = _SegmentedLoraLinear.apply(x, W, None, sizes, scales, *pairs)
    clean_dx, *clean_rest = torch.autograd.grad(clean, (x, *pairs[2:]), g)
    with torch.no_grad():
        pairs[0][0, 0] = float("nan")
    bad = _SegmentedLoraLinear.apply(x, W, None, sizes, scales, *pairs)
    dx, *rest = torch.autograd.grad(bad, (x, *pairs[2:]), g)
    assert bad[:n].isnan().any() and dx[:n].isnan().any()
    assert torch.equal(bad[n:], clean[n:]) and torch.equal(dx[n:], clean_dx[n:])
    base = sum(sizes[: scales.index(None)])  # the first row without a LoRA
    # nothing added to it: its row of the one base call (a call on fewer rows may block
    # its sums otherwise and differ in the last bit, as it does on AVX-512 CPUs)
    assert torch.equal(bad[base], F.linear(x, W)[base])
    assert all(torch.equal(a, c) for a, c in zip(rest, clean_rest, strict=True))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_segmented_lora_linear_on_a_bf16_base_equals_the_base_call_plus_deltas(layout):
    """bf16 input and base, fp32 adapters (the GPU set-up): the numbers of the base call plus
    each segment's fp32 update, cast back (the path taken before, and where this one is not)."""
    x, W, b, sizes, scales, pairs = _segments(torch.float32, True, layout, seed=6)
    x = x.detach().bfloat16().requires_grad_(True)
    W = W.bfloat16()
    b = b.detach().bfloat16().requires_grad_(True)
    g = torch.randn(x.shape[0], 5, 7).bfloat16()
    got = _SegmentedLoraLinear.apply(x, W, b, sizes, scales, *pairs)
    out, pieces, start, it = F.linear(x, W, b), [], 0, iter(pairs)
    for n, scale in zip(sizes, scales, strict=True):
        rows = out[start : start + n]
        if scale is not None:
            delta = _LoraDelta.apply(x[start : start + n].float(), next(it), next(it), scale)
            rows = (rows + delta).to(rows.dtype)
        pieces.append(rows)
        start += n
    want = torch.cat(pieces)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    leaves = [x, b, *pairs]
    grads = zip(
        torch.autograd.grad(got, leaves, g), torch.autograd.grad(want, leaves, g), strict=True
    )
    for a, e in grads:
        assert a.dtype == e.dtype
        torch.testing.assert_close(a, e, rtol=1e-2, atol=1e-2)


def test_target_logprobs_equal_cross_entropy():
    gen = torch.Generator().manual_seed(2)
    logits = (torch.randn(9, 50, generator=gen, dtype=torch.float64) * 3).requires_grad_(True)
    targets = torch.randint(0, 50, (9, 1), generator=gen)
    assert torch.autograd.gradcheck(lambda z: TargetLogprobs.apply(z, targets), (logits,))
    g = torch.randn(9, 1, dtype=torch.float64, generator=gen)
    got = TargetLogprobs.apply(logits, targets)
    want = -F.cross_entropy(logits, targets[:, 0], reduction="none")[:, None]
    torch.testing.assert_close(got, want)
    (d_got,) = torch.autograd.grad(got, logits, g)
    (d_want,) = torch.autograd.grad(want, logits, g)
    torch.testing.assert_close(d_got, d_want)


def test_target_logprobs_of_k_columns_equal_log_softmax():
    """(M, K) targets, one named twice in a row: log_softmax + gather's values and gradient."""
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(7, 40, generator=gen, dtype=torch.float64) * 3).requires_grad_(True)
    targets = torch.randint(0, 40, (7, 4), generator=gen)
    targets[2, 3] = targets[2, 1]
    assert torch.autograd.gradcheck(lambda z: TargetLogprobs.apply(z, targets), (logits,))
    g = torch.randn(7, 4, dtype=torch.float64, generator=gen)
    got = TargetLogprobs.apply(logits, targets)
    want = logits.log_softmax(-1).gather(-1, targets)
    torch.testing.assert_close(got, want)
    (d_got,) = torch.autograd.grad(got, logits, g)
    (d_want,) = torch.autograd.grad(want, logits, g)
    torch.testing.assert_close(d_got, d_want)
