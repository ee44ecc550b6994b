"""The sampler's extra outputs (target prompt logprobs, top-K sampled logprobs, alternative
prompt tokens) are per request: a mixed batch gives each request what it gives alone, and the
numbers are plain transformers'."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from treadle.engine.types import SampleRequest, SampleSpec
from treadle.errors import InvalidRequestError


def _lp(plain_model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = plain_model(input_ids=torch.tensor([tokens])).logits[0, :-1].float()
    return logits.log_softmax(-1)  # (T-1, V)


def _requests() -> list[SampleRequest]:
    a, b = [5, 17, 33, 2, 40, 41], [9, 8, 7, 6]
    ids = np.array([[1, 2], [3, -1], [-1, -1], [4, 5], [6, 7]], dtype=np.int64)  # (5, 2)
    return [
        SampleRequest(a, 1, SampleSpec(max_tokens=2, seed=1), target_prompt_ids=ids),
        SampleRequest(
            b, 2, SampleSpec(max_tokens=4, seed=2, stop_at_eos=False), topk_sample_logprobs=3
        ),
        SampleRequest(a, 1, SampleSpec(max_tokens=1, seed=3), prompt_alt_tokens_k=4),
        SampleRequest(b, 1, SampleSpec(max_tokens=3, seed=4), prompt_logprobs=True),
    ]


def test_mixed_batch_equals_alone_and_plain(engine, plain_model):
    reqs = _requests()
    together = engine.sample(reqs)
    alone = [engine.sample([r])[0] for r in _requests()]
    for t, s in zip(together, alone, strict=True):
        assert [q.tokens for q in t.sequences] == [q.tokens for q in s.sequences]
        for qt, qs in zip(t.sequences, s.sequences, strict=True):  # batching moves only ulps
            assert (qt.topk is None) == (qs.topk is None)
            if qt.topk is not None:
                assert [[i for i, _ in r] for r in qt.topk] == [[i for i, _ in r] for r in qs.topk]
                np.testing.assert_allclose(
                    [[v for _, v in r] for r in qt.topk],
                    [[v for _, v in r] for r in qs.topk],
                    atol=1e-5,
                )
    np.testing.assert_array_equal(
        together[2].prompt_alt_tokens[0], alone[2].prompt_alt_tokens[0]
    )  # same seed, same draws

    want_a = _lp(plain_model, reqs[0].prompt)  # (5, V)
    ids = torch.tensor(reqs[0].target_prompt_ids)
    expect = want_a.gather(-1, ids.clamp(min=0)).masked_fill(ids < 0, 0)
    np.testing.assert_allclose(together[0].target_prompt_logprobs, expect.numpy(), atol=2e-4)
    assert together[0].prompt_logprobs is None and together[3].target_prompt_logprobs is None

    for seq in together[1].sequences:
        full = _lp(plain_model, reqs[1].prompt + seq.tokens)[len(reqs[1].prompt) - 1 :]  # (4, V)
        vals, top = full.topk(3, dim=-1)
        assert [[t for t, _ in row] for row in seq.topk] == top.tolist()
        np.testing.assert_allclose([[v for _, v in row] for row in seq.topk], vals, atol=2e-4)
    assert together[0].sequences[0].topk is None

    alt_ids, alt_lps = together[2].prompt_alt_tokens  # (5, 4) each
    assert alt_ids.shape == alt_lps.shape == (5, 4)
    np.testing.assert_allclose(alt_lps, want_a.gather(-1, torch.tensor(alt_ids)).numpy(), atol=2e-4)


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("target_prompt_ids", np.zeros((2, 3), dtype=np.int64), "target_prompt_logprobs must be"),
        ("target_prompt_ids", np.full((3, 1), 10**6, dtype=np.int64), "outside the vocabulary"),
        ("topk_sample_logprobs", -1, "topk_sample_logprobs"),
        ("prompt_alt_tokens_k", -2, "prompt_alt_tokens_k"),
    ],
)
def test_bad_extras_are_named(engine, field, value, match):
    req = SampleRequest([1, 2, 3, 4], 1, SampleSpec(max_tokens=1))
    setattr(req, field, value)
    with pytest.raises(InvalidRequestError, match=match):
        engine.sample([req])
