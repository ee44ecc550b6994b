"""The incremental sampler (DecodeBatch) against the run-to-completion one: requests that
join a running batch at any step sample exactly what they sample alone, and streamed
tokens are the final ones.

    .venv/bin/python -m pytest -q tests/engine/test_sample_incremental.py
"""

from __future__ import annotations

import pytest

# the sharpened tiny model with three adapters, and its helpers (tests folders are not packages)
from test_sample import ATOL, engine, model_dir, prompts, req  # noqa: F401

import treadle.engine.sample as sample_mod
from treadle.engine.sample import DecodeBatch, sample
from treadle.engine.types import SampleRequest, SampleSpec
from treadle.errors import InvalidRequestError


def mixed_requests(engine, prompts) -> list[SampleRequest]:  # noqa: F811
    # a stop string that the request's own samples contain: its 4th token's text
    free = sample(engine, [req(prompts[2], n=2, adapter="ad-2", max_tokens=10, seed=6)])[0]
    stop_text = engine.tokenizer.decode(free.sequences[0].tokens[3:4], skip_special_tokens=False)
    free = sample(engine, [req(prompts[3], n=2, max_tokens=16, seed=7)])[0]
    stop_tok = free.sequences[1].tokens[6]  # and a stop token that one of them samples
    return [
        req(prompts[0], n=3, adapter="ad-1", max_tokens=12, seed=1),
        req(prompts[1], n=2, max_tokens=9, temperature=0.7, top_k=20, seed=2),
        req(prompts[2], n=1, adapter="ad-2", max_tokens=14, top_p=0.8, seed=3),
        req(prompts[3], n=2, adapter="ad-3", max_tokens=5, temperature=0, seed=4),
        req(prompts[1], n=1, adapter="ad-1", max_tokens=1, seed=5),
        SampleRequest(prompts[0], params=SampleSpec(max_tokens=0), prompt_logprobs=True),
        SampleRequest(
            prompts[2],
            2,
            SampleSpec(max_tokens=10, seed=6, stop_strings=[stop_text]),
            adapter="ad-2",
            prompt_logprobs=True,
            topk_sample_logprobs=3,
        ),  # fmt: skip
        req(prompts[3], n=2, max_tokens=16, seed=7, stop_tokens=[stop_tok]),
        req(prompts[0], n=1, adapter="ad-3", max_tokens=20, seed=8, stop_at_eos=False),
    ]


def staggered(engine, reqs, gaps, stream=True):  # noqa: F811
    """Add reqs[i] after gaps[i] more single steps, then run to the end: → the results in
    request order, their handles, and every streamed token."""
    batch, heard, done, handles = DecodeBatch(engine), [], {}, []
    for r, gap in zip(reqs, gaps, strict=True):
        for _ in range(gap):
            done.update(batch.step(max_steps=1, on_tokens=heard.extend))
        handles += batch.add([r], stream=[stream])
    while len(batch):
        done.update(batch.step(on_tokens=heard.extend))
    return [done[h] for h in handles], handles, heard


def assert_same(a, b):
    """Two results of the same request: the same tokens, logprobs up to batching ulps."""
    assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
    assert [s.stop_reason for s in a.sequences] == [s.stop_reason for s in b.sequences]
    for x, y in zip(a.sequences, b.sequences, strict=True):
        assert x.logprobs == pytest.approx(y.logprobs, abs=ATOL)
        assert (x.topk is None) == (y.topk is None)
        if x.topk is not None:
            assert [[t for t, _ in row] for row in x.topk] == [
                [t for t, _ in row] for row in y.topk
            ]
    if a.prompt_logprobs is not None:
        assert a.prompt_logprobs[0] is b.prompt_logprobs[0] is None
        assert a.prompt_logprobs[1:] == pytest.approx(b.prompt_logprobs[1:], abs=ATOL)


def test_requests_joining_a_running_batch_sample_what_they_sample_alone(engine, prompts):  # noqa: F811
    reqs = mixed_requests(engine, prompts)
    joined, _, _ = staggered(engine, reqs, gaps=[0, 3, 1, 5, 0, 2, 4, 1, 7])
    together = sample(engine, reqs)
    for r, res, whole in zip(reqs, joined, together, strict=True):
        assert len(res.sequences) == r.num_samples
        assert_same(res, sample(engine, [r])[0])
        assert_same(res, whole)
    assert joined[6].sequences[0].stop_reason == "stop"  # the stop string worked
    assert all(len(s.topk) == len(s.tokens) for s in joined[6].sequences)
    assert any(s.stop_reason == "stop" for s in joined[7].sequences)


def test_streamed_tokens_are_the_final_tokens_in_order(engine, prompts):  # noqa: F811
    reqs = mixed_requests(engine, prompts)
    results, handles, heard = staggered(engine, reqs, gaps=[0, 2, 0, 3, 1, 0, 2, 5, 1])
    by_row: dict[tuple[int, int], list] = {}
    for h, j, pos, token, lp in heard:
        by_row.setdefault((h, j), []).append((pos, token, lp))
    for h, r, res in zip(handles, reqs, results, strict=True):
        for j, seq in enumerate(res.sequences):
            got = by_row.get((h, j), [])
            if r.params.max_tokens <= 1:  # finished by add itself: nothing to stream
                assert got == []
                continue
            assert [p for p, _, _ in got] == list(range(len(seq.tokens)))
            assert [t for _, t, _ in got] == seq.tokens
            assert [lp for _, _, lp in got] == pytest.approx(seq.logprobs, abs=1e-6)
    # requests that did not ask for streaming are not reported
    _, _, quiet = staggered(engine, reqs[:3], gaps=[0, 2, 1], stream=False)
    assert quiet == []


def test_a_stream_of_arrivals_keeps_the_cache_bounded(engine, prompts):  # noqa: F811
    batch, done, handles, reqs = DecodeBatch(engine), {}, [], []
    longest = 0
    for i in range(30):
        r = req(prompts[i % 4], n=1 + i % 2, adapter=(None, "ad-1", "ad-2")[i % 3],
                max_tokens=4 + i % 7, seed=100 + i)  # fmt: skip
        reqs.append(r)
        handles += batch.add([r])
        for _ in range(2):
            done.update(batch.step(max_steps=1))
            if batch.cohort is not None:
                longest = max(longest, batch.cohort.length)
                assert batch.rows <= 16  # finished rows leave: about 3 requests in flight
    while len(batch):
        done.update(batch.step())
    # padding shared by every row is cut away: the cache never holds more than one prompt
    # and one completion's worth of positions
    assert longest <= max(map(len, prompts)) + 10
    for r, h in list(zip(reqs, handles, strict=True))[::5]:
        assert_same(done[h], sample(engine, [r])[0])


def test_until_and_max_steps_bound_a_call(engine, prompts):  # noqa: F811
    batch = DecodeBatch(engine)
    (h,) = batch.add([req(prompts[0], n=2, max_tokens=10, seed=1, stop_at_eos=False)])
    calls = []

    def until() -> bool:
        calls.append(1)
        return len(calls) == 3

    assert batch.step(until=until) == [] and len(calls) == 3  # three steps, then it returned
    assert batch.step(max_steps=2) == []
    assert int(batch.cohort.step.max()) == 5
    ((got, res),) = batch.step()
    assert got == h and [len(s.tokens) for s in res.sequences] == [10, 10]
    assert len(batch) == 0 and batch.step() == []
    # a scoring request finishes in add: the next step hands it back without decoding
    (h2,) = batch.add([SampleRequest(prompts[1], params=SampleSpec(max_tokens=0))])
    assert batch.has_results and batch.step(max_steps=1)[0][0] == h2


def test_an_invalid_request_changes_nothing(engine, prompts):  # noqa: F811
    batch = DecodeBatch(engine)
    good = req(prompts[0], n=2, max_tokens=8, seed=3)
    (h,) = batch.add([good])
    batch.step(max_steps=2)
    with pytest.raises(InvalidRequestError, match=r"requests\[1\]\.prompt"):
        batch.add([req(prompts[1], max_tokens=2), req([10**6], max_tokens=2)])
    assert batch.rows == 2 and len(batch) == 1
    done = dict(batch.step())
    assert_same(done[h], sample(engine, [good])[0])


def test_caches_that_cannot_join_decode_one_cohort_after_another(engine, prompts, monkeypatch):  # noqa: F811
    monkeypatch.setattr(sample_mod, "joinable", lambda cohort: False)
    reqs = mixed_requests(engine, prompts)[:4]
    joined, _, _ = staggered(engine, reqs, gaps=[0, 2, 1, 3])
    for r, res in zip(reqs, joined, strict=True):
        assert_same(res, sample(engine, [r])[0])


def test_decode_rows_keep_their_own_adapter_after_joins(engine, prompts):  # noqa: F811
    """Joined rows are routed to their own adapters: the same prompt and seed under two
    adapters gives two different answers, each the one it gives alone."""
    a = req(prompts[0], adapter="ad-1", max_tokens=12, seed=9)
    b = req(prompts[0], adapter="ad-3", max_tokens=12, seed=9)
    (ra, rb), _, _ = staggered(engine, [a, b], gaps=[0, 4])
    assert ra.sequences[0].tokens != rb.sequences[0].tokens
    assert_same(ra, sample(engine, [a])[0])
    assert_same(rb, sample(engine, [b])[0])
