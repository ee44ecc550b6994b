"""The training path's own autograd functions against the plain torch expressions they
replace: values and every gradient (float64 gradcheck, and float32 against autograd).

    .venv/bin/python -m pytest -q tests/engine/test_kernels.py
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from treadle.engine.lora import _LoraDelta, _LoraLinear
from treadle.engine.lora_kernels import _SegmentedLoraLinear
from treadle.engine.train import _TargetLogprobs


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


def _segments(dtype, bias: bool, seed: int = 3):
    """4 rows in 3 segments: 2 rows of adapter 0 (rank 3), 1 base row, 1 row of adapter 1
    (rank 2, another scale)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 5, 6, generator=gen, dtype=dtype).requires_grad_(True)  # (B, T, in)
    W = torch.randn(7, 6, generator=gen, dtype=dtype)
    b = torch.randn(7, generator=gen, dtype=dtype).requires_grad_(True) if bias else None
    pairs = [
        torch.randn(*shape, generator=gen, dtype=dtype).requires_grad_(True)
        for shape in ((3, 6), (7, 3), (2, 6), (7, 2))
    ]
    return x, W, b, (2, 1, 1), (0.5, None, 2.0), pairs


@pytest.mark.parametrize("bias", [False, True])
def test_segmented_lora_linear_gradcheck(bias):
    x, W, b, sizes, scales, pairs = _segments(torch.float64, bias)
    fn = lambda x, b, *p: _SegmentedLoraLinear.apply(x, W, b, sizes, scales, *p)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, b, *pairs))


@pytest.mark.parametrize("bias", [False, True])
def test_segmented_lora_linear_equals_each_rows_own_expression(bias):
    x, W, b, sizes, scales, (A0, B0, A1, B1) = _segments(torch.float32, bias, seed=4)
    g = torch.randn(4, 5, 7)
    leaves = [t for t in (x, b, A0, B0, A1, B1) if t is not None]
    got = _SegmentedLoraLinear.apply(x, W, b, sizes, scales, A0, B0, A1, B1)
    want = torch.cat(
        [_reference(x[:2], W, b, A0, B0, 0.5), F.linear(x[2:3], W, b)]
        + [_reference(x[3:], W, b, A1, B1, 2.0)]
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    grads = zip(
        torch.autograd.grad(got, leaves, g), torch.autograd.grad(want, leaves, g), strict=True
    )
    for a, e in grads:
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


def test_segmented_lora_linear_keeps_a_bad_adapter_to_its_rows():
    """A NaN adapter: its rows are NaN, forward and backward; every other row, and the other
    adapter's gradients, are exactly what they are without it."""
    x, W, _, sizes, scales, (A0, B0, A1, B1) = _segments(torch.float32, bias=False, seed=5)
    g = torch.randn(4, 5, 7)
    clean = _SegmentedLoraLinear.apply(x, W, None, sizes, scales, A0, B0, A1, B1)
    clean_dx, clean_dA1 = torch.autograd.grad(clean, (x, A1), g)
    with torch.no_grad():
        A0[0, 0] = float("nan")
    bad = _SegmentedLoraLinear.apply(x, W, None, sizes, scales, A0, B0, A1, B1)
    dx, dA1 = torch.autograd.grad(bad, (x, A1), g)
    assert bad[:2].isnan().any() and dx[:2].isnan().any()
    assert torch.equal(bad[2:], clean[2:]) and torch.equal(dx[2:], clean_dx[2:])
    assert torch.equal(bad[2], F.linear(x[2], W))  # the base row: nothing added
    assert torch.equal(dA1, clean_dA1)


def test_target_logprobs_equal_cross_entropy():
    gen = torch.Generator().manual_seed(2)
    logits = (torch.randn(9, 50, generator=gen, dtype=torch.float64) * 3).requires_grad_(True)
    targets = torch.randint(0, 50, (9,), generator=gen)
    assert torch.autograd.gradcheck(lambda z: _TargetLogprobs.apply(z, targets), (logits,))
    g = torch.randn(9, dtype=torch.float64, generator=gen)
    got = _TargetLogprobs.apply(logits, targets)
    want = -F.cross_entropy(logits, targets, reduction="none")
    torch.testing.assert_close(got, want)
    (d_got,) = torch.autograd.grad(got, logits, g)
    (d_want,) = torch.autograd.grad(want, logits, g)
    torch.testing.assert_close(d_got, d_want)
