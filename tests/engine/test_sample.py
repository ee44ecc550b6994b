"""The sampler against independent computations: plain transformers forward passes and
`generate`, LoRA weights merged into a plain model, the trainer's forward, and decoding
every request alone.

    .venv/bin/python -m pytest -q tests/engine/test_sample.py
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from treadle.engine import Engine
from treadle.engine.sample import sample
from treadle.engine.tiny import make_tiny_model
from treadle.engine.types import LoraSpec, SampleRequest, SampleSpec, TrainBatch, TrainDatum
from treadle.errors import InvalidRequestError

ADAPTERS = ("ad-1", "ad-2", "ad-3")
ATOL = 1e-4


def _sharpen(model: torch.nn.Module, seed: int = 0) -> None:
    """Re-draw weights so the random model is confident yet varied (entropy ~5.5 of 6.9 nats).

    HF's default init makes a model that repeats one token: greedy checks would prove little.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2 and "embed" not in name:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
        emb = model.get_input_embeddings().weight
        emb.copy_(torch.randn(emb.shape, generator=gen) * 0.1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(tmp_path_factory.mktemp("tiny"), arch="llama", size="tiny")
    model = AutoModelForCausalLM.from_pretrained(path)
    _sharpen(model)
    model.save_pretrained(path)
    return path


def _lora_weights(engine, seed: int) -> tuple[dict, dict]:
    """Random A and B (B nonzero, so the adapter changes the output) for attn + mlp layers."""
    gen = torch.Generator().manual_seed(seed)
    weights, scales = {}, {}
    for path in engine.bank.target_paths(LoraSpec(rank=4, train_unembed=False)):
        lin = engine.bank.modules[path]
        A = torch.randn(4, lin.in_features, generator=gen) / lin.in_features**0.5  # (r, in)
        B = torch.randn(lin.out_features, 4, generator=gen) * 0.5  # (out, r)
        weights[path], scales[path] = (A, B), 0.5
    return weights, scales


@pytest.fixture(scope="module")
def engine(model_dir):
    eng = Engine(model_dir)
    for i, key in enumerate(ADAPTERS):
        weights, scales = _lora_weights(eng, seed=100 + i)
        eng.bank.add(key, LoraSpec(rank=4, alpha=2.0, train_unembed=False), weights, scales)
    return eng


@pytest.fixture(scope="module")
def ref_models(model_dir, engine):
    """Plain transformers models: the base, and one per adapter with W + s·B·A merged in."""
    from transformers import AutoModelForCausalLM

    models = {None: AutoModelForCausalLM.from_pretrained(model_dir).eval()}
    for key in ADAPTERS:
        m = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        mods = dict(m.named_modules())
        with torch.no_grad():
            for path, pair in engine.bank.get(key).layers.items():
                mods[path].weight += pair.scale * pair.B @ pair.A  # (out, in)
        models[key] = m
    return models


def ref_logprobs(model, tokens: list[int]) -> list[float]:
    """log p(tokens[i] | tokens[:i]) for i >= 1 from one plain forward pass, fp32."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()  # (T, V)
    lp = logits[:-1].log_softmax(-1)  # (T-1, V)
    return lp.gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0].tolist()


def prompt(engine, text: str) -> list[int]:
    return engine.tokenizer.encode(text)


def req(p, n=1, adapter=None, **params) -> SampleRequest:
    return SampleRequest(prompt=p, num_samples=n, params=SampleSpec(**params), adapter=adapter)


@pytest.fixture(scope="module")
def prompts(engine):
    return [
        prompt(engine, "Question: Ana has 3 apples. He buys 2 more. How many"),
        prompt(engine, "Hi"),
        prompt(engine, "<|im_start|>user\nTell me a short fact.<|im_end|>\n"),
        prompt(engine, "Max has 12 coins."),
    ]


# ---- logprobs --------------------------------------------------------------------------------


def test_sampled_logprobs_equal_plain_forward_in_a_mixed_batch(engine, ref_models, prompts):
    reqs = [
        req(prompts[0], n=3, adapter="ad-1", max_tokens=12, seed=1),
        req(prompts[1], n=2, adapter=None, max_tokens=7, temperature=0.7, top_k=20, seed=2),
        req(prompts[2], n=1, adapter="ad-2", max_tokens=12, top_p=0.8, seed=3),
        req(prompts[3], n=2, adapter="ad-3", max_tokens=5, temperature=0, seed=4),
        req(prompts[1], n=2, adapter="ad-1", max_tokens=9, temperature=1.3, seed=5),
    ]
    results = sample(engine, reqs)
    for r, res in zip(reqs, results, strict=True):
        assert len(res.sequences) == r.num_samples
        for seq in res.sequences:
            assert len(seq.tokens) == len(seq.logprobs) == r.params.max_tokens
            assert seq.stop_reason == "length" or seq.tokens[-1] in engine.eos_token_ids
            want = ref_logprobs(ref_models[r.adapter], r.prompt + seq.tokens)[len(r.prompt) - 1 :]
            assert seq.logprobs == pytest.approx(want, abs=ATOL)


def test_prompt_logprobs_and_topk_equal_plain_forward(engine, ref_models, prompts):
    p = prompts[0]
    res = sample(
        engine,
        [
            SampleRequest(p, params=SampleSpec(max_tokens=0), prompt_logprobs=True),
            SampleRequest(
                p, params=SampleSpec(max_tokens=3), prompt_logprobs=True, topk_prompt_logprobs=5
            ),
            SampleRequest(prompts[1], params=SampleSpec(max_tokens=4), adapter="ad-2"),
            SampleRequest(
                prompts[3],
                adapter="ad-2",
                params=SampleSpec(max_tokens=0),
                prompt_logprobs=True,
                topk_prompt_logprobs=3,
            ),
        ],  # fmt: skip
    )
    # compute_logprobs: no new tokens, num_samples empty sequences
    assert [s.tokens for s in res[0].sequences] == [[]]
    assert res[0].sequences[0].stop_reason == "length"
    assert res[0].topk_prompt_logprobs is None and res[2].prompt_logprobs is None
    for r, key, text in ((res[0], None, p), (res[1], None, p), (res[3], "ad-2", prompts[3])):
        assert r.prompt_logprobs[0] is None and len(r.prompt_logprobs) == len(text)
        assert r.prompt_logprobs[1:] == pytest.approx(ref_logprobs(ref_models[key], text), abs=ATOL)

    with torch.no_grad():
        logits = ref_models["ad-2"](torch.tensor([prompts[3]])).logits[0]  # (T, V)
    vals, ids = logits[:-1].float().log_softmax(-1).topk(3, dim=-1)  # (T-1, 3)
    topk = res[3].topk_prompt_logprobs
    assert topk[0] is None and len(topk) == len(prompts[3])
    for pos, (row_v, row_i) in enumerate(zip(vals.tolist(), ids.tolist(), strict=True), start=1):
        assert [t for t, _ in topk[pos]] == row_i
        assert [v for _, v in topk[pos]] == pytest.approx(row_v, abs=ATOL)
    assert len(res[1].topk_prompt_logprobs[1]) == 5


def test_scoring_in_chunks_equals_plain_forward(engine, ref_models, prompts, monkeypatch):
    import treadle.engine.sample as sample_mod

    # a budget of about two rows per chunk: the scoring prefill runs in several pieces
    budget = 2 * max(map(len, prompts)) * engine.vocab_size
    monkeypatch.setattr(sample_mod, "LOGITS_BUDGET", budget)
    keys = [None, "ad-1", None, "ad-2", "ad-1"]
    texts = [*prompts, prompts[0]]
    reqs = [
        SampleRequest(p, params=SampleSpec(max_tokens=0), adapter=a, prompt_logprobs=True)
        for p, a in zip(texts, keys, strict=True)
    ]
    res = sample(engine, reqs)
    for p, key, r in zip(texts, keys, res, strict=True):
        assert r.prompt_logprobs[1:] == pytest.approx(ref_logprobs(ref_models[key], p), abs=ATOL)


def test_one_token_requests_need_no_cache(engine, ref_models, prompts):
    reqs = [
        req(p, n=2, adapter=a, max_tokens=1, seed=3)
        for p, a in zip(prompts, (*ADAPTERS, None), strict=True)
    ]
    for r, res in zip(reqs, sample(engine, reqs), strict=True):
        for seq in res.sequences:
            assert len(seq.tokens) == 1 and seq.stop_reason in ("length", "stop")
            want = ref_logprobs(ref_models[r.adapter], r.prompt + seq.tokens)[-1]
            assert seq.logprobs[0] == pytest.approx(want, abs=ATOL)


def test_sampler_and_trainer_agree(engine, prompts):
    """The trainer's forward (forward_only) scores the sampled tokens exactly as sampled."""
    engine.snapshot("ad-2", "snap-2")
    try:
        reqs = [
            req(prompts[0], n=2, adapter="ad-1", max_tokens=8, seed=1),
            req(prompts[1], n=1, adapter="snap-2", max_tokens=8, seed=2, top_p=0.9),
            req(prompts[2], n=1, adapter="ad-3", max_tokens=5, seed=3, temperature=0.5),
            req(prompts[3], n=1, adapter=None, max_tokens=8, seed=4),
        ]
        results = engine.sample(reqs)
        for r, res in zip(reqs[:3], results[:3], strict=True):
            data = []
            for seq in res.sequences:
                full = np.array(r.prompt + seq.tokens, dtype=np.int64)
                inputs = {"target_tokens": full[1:], "weights": np.ones(len(full) - 1)}
                data.append(TrainDatum(tokens=full[:-1], loss_inputs=inputs))
            out = engine.forward_backward([TrainBatch(r.adapter, data)], forward_only=True)[0]
            for seq, o in zip(res.sequences, out.outputs, strict=True):
                trainer_lp = o["logprobs"][len(r.prompt) - 1 :].tolist()
                assert seq.logprobs == pytest.approx(trainer_lp, abs=ATOL)
        # the snapshot samples like the adapter it was taken from
        same = engine.sample(
            [req(prompts[1], n=1, adapter="ad-2", max_tokens=8, seed=2, top_p=0.9)]
        )
        assert same[0].sequences[0].tokens == results[1].sequences[0].tokens
    finally:
        engine.drop_snapshot("snap-2")


# ---- determinism ----------------------------------------------------------------------------


def test_same_seed_same_output_whatever_the_batch(engine, prompts):
    alone = sample(engine, [req(prompts[0], n=3, max_tokens=10, seed=42, top_p=0.9)])[0]
    crowd = sample(
        engine,
        [
            req(prompts[2], n=4, adapter="ad-1", max_tokens=6, seed=7),
            req(prompts[0], n=3, max_tokens=10, seed=42, top_p=0.9),
            req(prompts[1], n=2, adapter="ad-3", max_tokens=14, temperature=0),
        ],
    )[1]
    assert [s.tokens for s in crowd.sequences] == [s.tokens for s in alone.sequences]
    for a, b in zip(alone.sequences, crowd.sequences, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=ATOL)
    # the samples of one request differ from each other, and another seed gives other tokens
    assert len({tuple(s.tokens) for s in alone.sequences}) == 3
    other = sample(engine, [req(prompts[0], n=3, max_tokens=10, seed=43, top_p=0.9)])[0]
    assert [s.tokens for s in other.sequences] != [s.tokens for s in alone.sequences]
    # no seed: a fresh draw each call
    a, b = (sample(engine, [req(prompts[0], max_tokens=10)])[0] for _ in range(2))
    assert a.sequences[0].tokens != b.sequences[0].tokens


def test_greedy_equals_generate_and_argmax(engine, ref_models, prompts):
    reqs = [req(p, n=2, max_tokens=12, temperature=0, stop_at_eos=False) for p in prompts]
    first = sample(engine, reqs)
    again = sample(engine, reqs[::-1])[::-1]
    base = ref_models[None]
    for p, res, res2 in zip(prompts, first, again, strict=True):
        a, b = res.sequences
        assert a.tokens == b.tokens == res2.sequences[0].tokens
        gen = base.generate(
            torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None,
            pad_token_id=0, attention_mask=torch.ones(1, len(p), dtype=torch.long),
        )  # fmt: skip
        assert a.tokens == gen[0, len(p) :].tolist()
        # argmax decoding, step by step: every chosen token is the mode of the full forward
        with torch.no_grad():
            logits = base(torch.tensor([p + a.tokens])).logits[0, len(p) - 1 : -1]  # (m, V)
        assert logits.argmax(-1).tolist() == a.tokens


def test_top_k_and_top_p_restrict_the_choice(engine, ref_models, prompts):
    p = prompts[2]
    res = sample(
        engine,
        [req(p, n=8, max_tokens=6, top_k=2, seed=9), req(p, n=8, max_tokens=6, top_p=0.3, seed=9)],
    )
    base = ref_models[None]
    for seq in res[0].sequences:
        with torch.no_grad():
            logits = base(torch.tensor([p + seq.tokens])).logits[0, len(p) - 1 : -1]  # (m, V)
        top2 = logits.topk(2, dim=-1).indices  # (m, 2)
        assert all(t in row for t, row in zip(seq.tokens, top2.tolist(), strict=True))
    for seq in res[1].sequences:
        with torch.no_grad():
            logits = base(torch.tensor([p + seq.tokens])).logits[0, len(p) - 1 : -1]  # (m, V)
        probs = logits.softmax(-1)  # (m, V)
        for t, row in zip(seq.tokens, probs, strict=True):
            # the nucleus: tokens whose better-ranked mass is below top_p
            assert float(row[row > row[t]].sum()) < 0.3


# ---- stopping -------------------------------------------------------------------------------


def test_stop_token_is_included_and_stops(engine, prompts):
    free = sample(engine, [req(prompts[0], n=2, max_tokens=16, seed=5)])[0].sequences
    stop_tok = free[0].tokens[5]
    cut = free[0].tokens.index(stop_tok) + 1
    res = sample(
        engine,
        [
            req(prompts[0], n=2, max_tokens=16, seed=5, stop_tokens=[stop_tok]),
            req(prompts[1], n=3, max_tokens=16, seed=1),  # companions that run longer
        ],
    )[0].sequences
    assert res[0].tokens == free[0].tokens[:cut] and res[0].stop_reason == "stop"
    assert res[0].logprobs == pytest.approx(free[0].logprobs[:cut], abs=ATOL)
    # the other sample stops at its own first stop_tok, or runs to max_tokens
    if stop_tok in free[1].tokens:
        cut1 = free[1].tokens.index(stop_tok) + 1
        assert (res[1].tokens, res[1].stop_reason) == (free[1].tokens[:cut1], "stop")
    else:
        assert (res[1].tokens, res[1].stop_reason) == (free[1].tokens, "length")


def test_eos_stops_unless_stop_at_eos_is_false(engine, prompts):
    free = sample(engine, [req(prompts[3], max_tokens=12, temperature=0)])[0].sequences[0]
    eos = free.tokens[4]
    cut = free.tokens.index(eos) + 1
    saved = engine.eos_token_ids
    engine.eos_token_ids = [eos]  # a token this greedy run is known to produce
    try:
        stop, run_on = sample(
            engine,
            [
                req(prompts[3], max_tokens=12, temperature=0),
                req(prompts[3], max_tokens=12, temperature=0, stop_at_eos=False),
            ],
        )
    finally:
        engine.eos_token_ids = saved
    assert stop.sequences[0].tokens == free.tokens[:cut]
    assert stop.sequences[0].stop_reason == "stop"
    assert run_on.sequences[0].tokens == free.tokens
    assert run_on.sequences[0].stop_reason == "length"


def test_stop_string_stops_after_the_completing_token(engine, prompts):
    tok = engine.tokenizer
    free = sample(engine, [req(prompts[2], n=2, max_tokens=20, seed=11)])[0].sequences
    text = tok.decode(free[0].tokens, skip_special_tokens=False)
    # an ASCII stretch of the text, cut across token boundaries
    start = next(i for i in range(len(text) - 4) if text[i : i + 3].isascii() and i > 3)
    stop = text[start : start + 3]
    cut = next(
        n
        for n in range(1, len(free[0].tokens) + 1)
        if stop in tok.decode(free[0].tokens[:n], skip_special_tokens=False)
    )
    res = sample(
        engine,
        [
            req(prompts[2], n=2, max_tokens=20, seed=11, stop_strings=["\x00never", stop]),
            req(prompts[0], n=2, max_tokens=20, seed=3),
        ],
    )[0].sequences
    assert res[0].tokens == free[0].tokens[:cut] and res[0].stop_reason == "stop"
    assert stop in tok.decode(res[0].tokens, skip_special_tokens=False)


def test_max_tokens_respected(engine, prompts):
    res = sample(
        engine,
        [req(prompts[0], n=2, max_tokens=m, seed=m, stop_at_eos=False) for m in (1, 3, 17)],
    )
    for m, r in zip((1, 3, 17), res, strict=True):
        assert [len(s.tokens) for s in r.sequences] == [m, m]
        assert {s.stop_reason for s in r.sequences} == {"length"}


# ---- batching -------------------------------------------------------------------------------


class _Spy:
    """Records the rows of every model call and the adapter keys routed for it."""

    def __init__(self, engine):
        self.engine, self.calls, self.keys = engine, [], None

    @contextlib.contextmanager
    def rows(self, keys):
        with self.engine.bank.rows(keys):
            prev, self.keys = self.keys, list(keys)
            try:
                yield
            finally:
                self.keys = prev

    def hook(self, module, args, kwargs):
        ids = kwargs["input_ids"]
        self.calls.append((tuple(ids.shape), self.keys))


def test_prefill_once_per_prompt_and_keys_follow_rows(engine, prompts):
    spy = _Spy(engine)
    view = type("View", (), {})()
    view.__dict__.update(vars(engine))
    view.bank = spy
    view.prefix_cache = None  # one prefill pass over every row (the prefix cache: its own tests)
    handle = engine.model.register_forward_pre_hook(spy.hook, with_kwargs=True)
    try:
        reqs = [
            req(prompts[0], n=4, adapter="ad-1", max_tokens=6, seed=1),
            req(prompts[1], n=3, adapter=None, max_tokens=3, seed=2),
            req(prompts[0], n=2, adapter="ad-1", max_tokens=2, seed=3),  # same prefill row
            req(prompts[0], n=1, adapter="ad-2", max_tokens=4, seed=4),
        ]
        res = sample(view, reqs)
    finally:
        handle.remove()
    (prefill_shape, prefill_keys), *decode = spy.calls
    assert prefill_shape == (3, len(prompts[0])) and prefill_keys == ["ad-1", None, "ad-2"]
    assert len(decode) == 5  # max_tokens 6: the last token needs no forward
    for shape, keys in decode:
        assert shape[1] == 1 and len(keys) == shape[0]
    # every routed row belongs to an unfinished sample with that adapter
    assert decode[0][1] == ["ad-1"] * 4 + [None] * 3 + ["ad-1"] * 2 + ["ad-2"]
    assert decode[-1][1] == ["ad-1"] * 4
    assert [len(s.tokens) for r in res for s in r.sequences] == [6] * 4 + [3] * 3 + [2] * 2 + [4]


def test_mixed_adapter_batch_equals_each_request_alone(engine, prompts):
    reqs = [
        req(prompts[0], n=2, adapter="ad-1", max_tokens=10, seed=1),
        req(prompts[1], n=1, adapter="ad-2", max_tokens=8, seed=2, temperature=0),
        req(prompts[2], n=2, adapter=None, max_tokens=6, seed=3, top_k=50),
        req(prompts[3], n=1, adapter="ad-3", max_tokens=10, seed=4),
        req(prompts[0], n=1, adapter="ad-3", max_tokens=10, seed=1),
    ]
    together = sample(engine, reqs)
    for r, res in zip(reqs, together, strict=True):
        alone = sample(engine, [r])[0]
        assert [s.tokens for s in res.sequences] == [s.tokens for s in alone.sequences]
        for a, b in zip(alone.sequences, res.sequences, strict=True):
            assert a.logprobs == pytest.approx(b.logprobs, abs=ATOL)
    # the adapters matter: the same prompt and seed give other tokens under another adapter
    assert together[0].sequences[0].tokens != together[4].sequences[0].tokens


# ---- validation -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (dict(prompt=[5, 10**6]), "prompt"),
        (dict(prompt=[]), "prompt"),
        (dict(prompt=[-1]), "prompt"),
        (dict(num_samples=0), "num_samples"),
        (dict(max_tokens=2000), "max_tokens"),
        (dict(max_tokens=-1), "max_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-3), "top_k"),
        (dict(stop_tokens=[10**6]), "stop_tokens"),
        (dict(stop_strings=[""]), "stop_strings"),
        (dict(topk_prompt_logprobs=-1), "topk_prompt_logprobs"),
    ],
)
def test_invalid_requests_name_the_field(engine, change, field):
    spec_keys = set(SampleSpec.__dataclass_fields__)
    spec = SampleSpec(**{k: v for k, v in change.items() if k in spec_keys})
    other = {k: v for k, v in change.items() if k not in spec_keys}
    bad = SampleRequest(**{"prompt": [1, 2, 3], **other, "params": spec})
    good = req([1, 2, 3], max_tokens=2)
    with pytest.raises(InvalidRequestError, match=field):
        sample(engine, [good, bad])


def test_qwen3_architecture(tmp_path):
    """Another architecture (q/k norms, explicit head_dim): greedy = generate, logprobs = forward."""
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(tmp_path, arch="qwen3", size="tiny")
    model = AutoModelForCausalLM.from_pretrained(path)
    _sharpen(model, seed=1)
    model.save_pretrained(path)
    eng = Engine(path)
    p1, p2 = prompt(eng, "Question: Li has 7 pens."), prompt(eng, "Hello!")
    greedy, sampled = eng.sample(
        [req(p1, max_tokens=10, temperature=0, stop_at_eos=False), req(p2, n=2, max_tokens=10)]
    )
    gen = model.generate(
        torch.tensor([p1]), max_new_tokens=10, do_sample=False, pad_token_id=0,
        attention_mask=torch.ones(1, len(p1), dtype=torch.long),
    )  # fmt: skip
    assert greedy.sequences[0].tokens == gen[0, len(p1) :].tolist()
    for seq in sampled.sequences:
        want = ref_logprobs(model, p2 + seq.tokens)[len(p2) - 1 :]
        assert seq.logprobs == pytest.approx(want, abs=ATOL)
