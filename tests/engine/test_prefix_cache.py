"""The prefix cache across requests (treadle.engine.prefix_cache, sample_prefill): a hit
gives what no cache gives (an engine without one, and plain transformers), the cache stays
within its byte budget, and changed weights never meet an old entry.

    .venv/bin/python -m pytest -q tests/engine/test_prefix_cache.py
"""

from __future__ import annotations

import pytest
import torch

# the sharpened tiny model with three adapters, and its helpers (tests folders are not packages)
from test_sample import (  # noqa: F401
    ADAPTERS,
    ATOL,
    _sharpen,
    engine,
    model_dir,
    ref_logprobs,
    ref_models,
    req,
)

from treadle.engine import Engine
from treadle.engine.prefix_cache import BLOCK, PrefixCache
from treadle.engine.tiny import make_tiny_model
from treadle.engine.types import AdamSpec, LoraSpec, SampleRequest, SampleSpec, TrainBatch


def _tokens(n: int, seed: int, vocab: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=gen).tolist()


@pytest.fixture(scope="module")
def uncached(model_dir, engine):  # noqa: F811
    """The same model and adapters without a prefix cache: the reference a hit must equal."""
    eng = Engine(model_dir, prefix_cache_bytes=0)
    for key in ADAPTERS:
        adapter = engine.bank.get(key)
        weights = {p: (pair.A, pair.B) for p, pair in adapter.layers.items()}
        scales = {p: pair.scale for p, pair in adapter.layers.items()}
        eng.bank.add(key, adapter.spec, weights, scales)
    return eng


def _same(a, b, atol=1e-5):
    assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
    for x, y in zip(a.sequences, b.sequences, strict=True):
        assert x.logprobs == pytest.approx(y.logprobs, abs=atol)


def test_second_turn_and_repeated_prompt_hit_and_equal_the_uncached_path(
    engine,  # noqa: F811
    uncached,
    ref_models,  # noqa: F811
):
    assert engine.prefix_cache is not None and uncached.prefix_cache is None
    V = engine.vocab_size
    turn1 = _tokens(70, 1, V)
    grpo = _tokens(45, 2, V)
    first = [
        req(turn1, n=2, adapter="ad-1", max_tokens=12, seed=1),
        req(grpo, n=3, max_tokens=8, seed=2, top_p=0.9),
    ]
    for r in engine.sample(first):
        assert r.prompt_cache_hit_tokens == 0
    reply = engine.sample([req(turn1, adapter="ad-1", max_tokens=10, seed=3)])[0]
    turn2 = turn1 + reply.sequences[0].tokens + _tokens(9, 4, V)
    second = [
        req(turn2, n=2, adapter="ad-1", max_tokens=12, seed=5),  # the next turn
        req(grpo, n=3, max_tokens=8, seed=6, top_p=0.9),  # GRPO: the same prompt again
        req(grpo, n=1, adapter="ad-2", max_tokens=8, seed=6),  # other weights: a miss
        req(_tokens(30, 7, V), n=2, adapter="ad-3", max_tokens=6, seed=7),  # new: a miss
        # cached, but its prompt logprobs need every position: it runs whole
        SampleRequest(turn1, 1, SampleSpec(max_tokens=4, seed=8), "ad-1", prompt_logprobs=True),
    ]
    got, want = engine.sample(second), uncached.sample(second)
    # the whole cached first turn; the repeated prompt but its last token (it must run)
    assert [r.prompt_cache_hit_tokens for r in got] == [70, 44, 0, 0, 0]
    for r, a, b in zip(second, got, want, strict=True):
        _same(a, b)
        for seq in a.sequences:  # and against plain transformers
            full = ref_logprobs(ref_models[r.adapter], r.prompt + seq.tokens)
            assert seq.logprobs == pytest.approx(full[len(r.prompt) - 1 :], abs=ATOL)
    assert got[4].prompt_logprobs[1:] == pytest.approx(want[4].prompt_logprobs[1:], abs=1e-5)
    # a third turn extends the second: the second's entry replaced the first's
    turn3 = turn2 + got[0].sequences[1].tokens + _tokens(5, 9, V)
    third = [req(turn3, adapter="ad-1", max_tokens=6, seed=10)]
    hit = engine.sample(third)[0]
    assert hit.prompt_cache_hit_tokens == len(turn2)
    _same(hit, uncached.sample(third)[0])


def test_scopes_never_share_entries(engine, uncached):  # noqa: F811
    prompt = _tokens(40, 11, engine.vocab_size)

    def asked(scope: str) -> SampleRequest:
        r = req(prompt, max_tokens=5, seed=12)
        r.prefix_scope = scope
        return r

    assert engine.sample([asked("tenant-a")])[0].prompt_cache_hit_tokens == 0
    assert engine.sample([asked("tenant-b")])[0].prompt_cache_hit_tokens == 0
    both = engine.sample([asked("tenant-a"), asked("tenant-c")])
    assert [r.prompt_cache_hit_tokens for r in both] == [39, 0]  # one prefill row, two scopes
    _same(both[1], uncached.sample([asked("tenant-c")])[0])


def test_changed_weights_never_meet_old_entries(engine, uncached, sft_datum_of):  # noqa: F811
    """A live adapter after an optim_step, and a snapshot made again under the same id."""
    V = engine.vocab_size
    prompt = _tokens(50, 13, V)
    spec = LoraSpec(rank=4, alpha=8.0, train_unembed=False)
    for eng in (engine, uncached):
        eng.create_adapter("live", spec)
        with torch.no_grad():
            for pair in eng.bank.live("live").layers.values():
                pair.B.copy_(torch.full(pair.B.shape, 0.05))
    ask = [req(prompt, adapter="live", max_tokens=8, seed=14)]
    engine.sample(ask)
    assert engine.sample(ask)[0].prompt_cache_hit_tokens == 49  # the same weights: a hit
    for eng in (engine, uncached):
        eng.forward_backward([TrainBatch("live", [sft_datum_of(prompt)])])
        eng.optim_step("live", AdamSpec(learning_rate=0.05))
    after = engine.sample(ask)[0]
    assert after.prompt_cache_hit_tokens == 0
    _same(after, uncached.sample(ask)[0])
    # a snapshot dropped and taken again under its id holds other weights: a miss
    engine.snapshot("live", "snap:x")
    engine.sample([req(prompt, adapter="snap:x", max_tokens=4, seed=15)])
    for eng in (engine, uncached):
        eng.forward_backward([TrainBatch("live", [sft_datum_of(prompt)])])
        eng.optim_step("live", AdamSpec(learning_rate=0.05))
    engine.drop_snapshot("snap:x")
    engine.snapshot("live", "snap:x")
    uncached.snapshot("live", "snap:x")
    again = [req(prompt, adapter="snap:x", max_tokens=8, seed=16)]
    got = engine.sample(again)[0]
    assert got.prompt_cache_hit_tokens == 0
    _same(got, uncached.sample(again)[0])


@pytest.fixture
def sft_datum_of():
    import numpy as np

    from treadle.engine.types import TrainDatum

    def make(prompt: list[int]) -> TrainDatum:
        tokens = np.asarray(prompt[:-1])
        targets = np.asarray(prompt[1:])
        return TrainDatum(tokens, {"target_tokens": targets, "weights": np.ones(len(targets))})

    return make


def test_the_byte_budget_bounds_the_cache_least_recently_used_first():
    H, D = 2, 4
    per_token = 2 * H * D * 4  # keys and values, fp32, one layer
    pc = PrefixCache(budget_bytes=3 * 32 * per_token)  # three 32-token prompts

    def kv(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(torch.zeros(H, n, D), torch.zeros(H, n, D))]

    prompts = [tuple(range(i * 100, i * 100 + 32)) for i in range(5)]
    for p in prompts[:3]:
        assert pc.store(("base", ""), p, kv(32))
    assert pc.lookup(("base", ""), prompts[0] + (7,)).tokens == 32  # 0 is now most recent
    for p in prompts[3:]:
        assert pc.store(("base", ""), p, kv(32))
        assert pc.bytes <= pc.budget
    assert len(pc) == 3 and pc.evicted == 2
    kept = [pc.lookup(("base", ""), p).tokens for p in prompts]
    assert kept == [32, 0, 0, 32, 32]  # 1 and 2, the least recently used, went
    assert not pc.store(("base", ""), tuple(range(200)), kv(200))  # larger than the budget
    assert not pc.store(("base", ""), tuple(range(BLOCK - 1)), kv(BLOCK - 1))  # too short
    # another version of the same tokens is another entry
    assert pc.lookup(("frozen", 1, ""), prompts[0]).tokens == 0


def test_an_engine_keeps_its_cache_within_budget(model_dir):  # noqa: F811
    eng = Engine(model_dir, prefix_cache_bytes=200_000)
    for i in range(12):
        eng.sample([req(_tokens(60, 100 + i, eng.vocab_size), max_tokens=2, seed=i)])
        assert eng.prefix_cache.bytes <= 200_000
    assert eng.prefix_cache.evicted > 0 and len(eng.prefix_cache) > 0


def test_sliding_window_moe_model_hits_exactly(tmp_path):
    """gpt_oss: sliding-window layers (window 16) beside full ones, experts; prompts longer
    than the window, so the cached part reaches past it."""
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(tmp_path, arch="gpt_oss", size="tiny")
    plain = AutoModelForCausalLM.from_pretrained(path)
    _sharpen(plain, seed=3)
    plain.save_pretrained(path)
    plain.eval()
    cached, ref = Engine(path), Engine(path, prefix_cache_bytes=0)
    assert cached.prefix_cache is not None
    V = cached.vocab_size
    turn1 = _tokens(40, 21, V)
    cached.sample([req(turn1, max_tokens=4, seed=1)])
    asks = [
        req(turn1 + _tokens(20, 22, V), n=2, max_tokens=10, seed=2),
        req(turn1, n=2, max_tokens=10, seed=3),
        req(_tokens(25, 23, V), max_tokens=10, seed=4),
    ]
    got, want = cached.sample(asks), ref.sample(asks)
    assert [r.prompt_cache_hit_tokens for r in got] == [40, 39, 0]
    for r, a, b in zip(asks, got, want, strict=True):
        _same(a, b)
        for seq in a.sequences:
            full = ref_logprobs(plain, r.prompt + seq.tokens)
            assert seq.logprobs == pytest.approx(full[len(r.prompt) - 1 :], abs=ATOL)
