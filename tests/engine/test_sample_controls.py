"""Sampling controls (constraints, logit_bias, min_p, penalties) against independent
computations: samples parsed and validated by jsonschema and matched by `re`; the
distribution each token was drawn from recomputed from plain transformers logits with
transformers' own logits processors and OpenAI's penalty formula; and the rows without
controls of a mixed batch bit for bit those of a batch without the controlled rows.

    .venv/bin/python -m pytest -q tests/engine/test_sample_controls.py
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from transformers import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor

from treadle.engine.sample import sample
from treadle.engine.sample_controls import RowControls, controlled_logits
from treadle.engine.sample_utils import pick_tokens
from treadle.engine.types import Constraint, SampleRequest, SampleSpec
from treadle.errors import InvalidRequestError

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "kind": {"enum": ["cat", "dog"]},
    },
    "required": ["name", "age", "ok", "kind"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{3,6}-[0-9]{2}"


def req(p, n=1, **params) -> SampleRequest:
    return SampleRequest(prompt=p, num_samples=n, params=SampleSpec(**params))


def text_of(engine, tokens: list[int]) -> str:
    """The sampled text without its final end-of-sequence token."""
    if tokens and tokens[-1] in engine.eos_token_ids:
        tokens = tokens[:-1]
    return engine.tokenizer.decode(tokens, skip_special_tokens=False)


@pytest.fixture(scope="module")
def prompts(engine):
    enc = engine.tokenizer.encode
    return [enc("Question: Ana has 3 apples."), enc("Hi"), enc("Max has 12 coins and")]


# ---- constrained decoding -----------------------------------------------------------------


def test_every_json_schema_sample_parses_and_validates(engine, prompts):
    c = Constraint("json_schema", json.dumps(SCHEMA))
    res = sample(
        engine, [req(p, n=4, max_tokens=80, seed=i, constraint=c) for i, p in enumerate(prompts)]
    )
    for r in res:
        for s in r.sequences:
            assert s.stop_reason == "stop"
            jsonschema.validate(json.loads(text_of(engine, s.tokens)), SCHEMA)


def test_regex_and_grammar_samples_match(engine, prompts):
    lark = 'start: "yes" | "no" | NUM\nNUM: /[0-9]{1,3}/'
    res = sample(
        engine,
        [
            req(prompts[0], n=6, max_tokens=40, seed=1, constraint=Constraint("regex", REGEX)),
            req(prompts[1], n=6, max_tokens=10, seed=2, constraint=Constraint("grammar", lark)),
        ],
    )
    for s in res[0].sequences:
        assert s.stop_reason == "stop" and re.fullmatch(REGEX, text_of(engine, s.tokens))
    for s in res[1].sequences:
        assert re.fullmatch(r"yes|no|[0-9]{1,3}", text_of(engine, s.tokens))


def test_a_constrained_greedy_row_takes_the_best_allowed_token(engine, plain_model, prompts):
    """Greedy under a constraint: each token is the argmax of the plain logits over the
    tokens the regex allows (here: digits only)."""
    p = prompts[2]
    s = sample(
        engine, [req(p, max_tokens=4, temperature=0, constraint=Constraint("regex", "[0-9]{4}"))]
    )[0].sequences[0]
    digits = [
        t for t in range(engine.vocab_size) if re.fullmatch("[0-9]+", engine.tokenizer.decode([t]))
    ]
    with torch.no_grad():
        logits = plain_model(torch.tensor([p + s.tokens])).logits[0, len(p) - 1 :]  # (5, V)
    for i, t in enumerate(s.tokens[:4]):
        assert t == digits[int(logits[i, digits].argmax())]
    assert s.sampling_logprobs[:4] == [0.0] * 4  # greedy: drawn with certainty


# ---- logit_bias, min_p, penalties against the formulas ------------------------------------


def test_logit_bias_minus_100_never_emits_the_token(engine, prompts):
    free = sample(engine, [req(p, n=4, max_tokens=24, seed=7) for p in prompts])
    banned = sorted({t for r in free for s in r.sequences for t in s.tokens})[:64]
    bias = {t: -100.0 for t in banned}
    res = sample(engine, [req(p, n=4, max_tokens=24, seed=7, logit_bias=bias) for p in prompts])
    res += sample(engine, [req(p, max_tokens=24, temperature=0, logit_bias=bias) for p in prompts])
    for r in res:
        for s in r.sequences:
            assert not set(s.tokens) & set(banned)
    # +100 makes a token the certain choice
    forced = sample(engine, [req(prompts[0], n=2, max_tokens=5, seed=1, logit_bias={42: 100.0})])
    assert all(s.tokens == [42] * 5 for s in forced[0].sequences)


def _drawn_from(plain_model, prompt, tokens, spec: SampleSpec) -> list[float]:
    """The logprob of each token under the distribution the spec says it was drawn from,
    from plain transformers logits: HF's repetition penalty and min-p processors,
    OpenAI's presence / frequency formula, the bias added, the temperature divided."""
    with torch.no_grad():
        all_logits = plain_model(torch.tensor([prompt + tokens])).logits[0].float()  # (T, V)
    out = []
    for i, t in enumerate(tokens):
        x = all_logits[len(prompt) - 1 + i].clone()[None]  # (1, V)
        for tid, b in spec.logit_bias.items():
            x[0, tid] += b
        seen = torch.tensor([prompt + tokens[:i]])  # (1, L)
        if spec.repetition_penalty != 1.0:
            x = RepetitionPenaltyLogitsProcessor(spec.repetition_penalty)(seen, x)
        counts = torch.bincount(torch.tensor(tokens[:i], dtype=torch.long), minlength=x.shape[-1])
        x = x - spec.frequency_penalty * counts - spec.presence_penalty * (counts > 0).float()
        x = x / spec.temperature
        if spec.min_p > 0:
            x = MinPLogitsWarper(spec.min_p)(seen, x)
        out.append(float(x.log_softmax(-1)[0, t]))
    return out


@pytest.mark.parametrize(
    "controls",
    [
        dict(repetition_penalty=1.8),
        dict(repetition_penalty=0.7),
        dict(presence_penalty=1.5, frequency_penalty=0.9),
        dict(frequency_penalty=-1.0),
        dict(min_p=0.2, temperature=0.7),
        dict(logit_bias={5: 3.0, 9: -4.0, 40: 7.5}),
        dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5, min_p=0.05,
             logit_bias={11: 2.0}, temperature=1.2),
    ],
)  # fmt: skip
def test_penalties_and_filters_follow_their_formulas(engine, plain_model, prompts, controls):
    reqs = [
        req(p, n=2, max_tokens=16, seed=3 + i, stop_at_eos=False, **controls)
        for i, p in enumerate(prompts)
    ]
    for r, res in zip(reqs, sample(engine, reqs), strict=True):
        for s in res.sequences:
            assert s.sampling_logprobs is not None
            want = _drawn_from(plain_model, r.prompt, s.tokens, r.params)
            assert s.sampling_logprobs == pytest.approx(want, abs=2e-4)
            with torch.no_grad():  # logprobs stay the raw policy's
                raw = plain_model(torch.tensor([r.prompt + s.tokens])).logits[0].float()
            lp = raw[len(r.prompt) - 1 : -1].log_softmax(-1)
            pol = lp.gather(-1, torch.tensor(s.tokens)[:, None])[:, 0].tolist()
            assert s.logprobs == pytest.approx(pol, abs=2e-4)
            assert s.sampling_logprobs != pytest.approx(s.logprobs, abs=1e-3)


def test_penalties_change_what_is_sampled(engine, prompts):
    """A strong frequency penalty makes repeats rarer than in the same draws without it."""
    base = sample(engine, [req(p, n=4, max_tokens=32, seed=5, temperature=0.5) for p in prompts])
    pen = sample(
        engine,
        [
            req(p, n=4, max_tokens=32, seed=5, temperature=0.5, frequency_penalty=2.0)
            for p in prompts
        ],
    )

    def repeats(results):
        return sum(len(s.tokens) - len(set(s.tokens)) for r in results for s in r.sequences)

    assert repeats(pen) < repeats(base)


def test_a_raw_request_reports_no_sampling_logprobs(engine, prompts):
    s = sample(engine, [req(prompts[0], max_tokens=4, seed=1)])[0].sequences[0]
    assert s.sampling_logprobs is None


# ---- isolation ----------------------------------------------------------------------------


def _plain_requests(prompts):
    return [
        req(prompts[0], n=2, max_tokens=12, seed=1),
        req(prompts[1], max_tokens=9, temperature=0),
        req(prompts[2], n=2, max_tokens=14, seed=3, top_p=0.9, temperature=0.8),
    ]


def _controlled_requests(prompts):
    return [
        req(prompts[1], n=2, max_tokens=30, seed=5, constraint=Constraint("regex", REGEX)),
        req(prompts[0], max_tokens=7, seed=6, repetition_penalty=1.4, logit_bias={3: 5.0}, min_p=0.05),
        req(prompts[2], n=2, max_tokens=20, temperature=0, presence_penalty=2.0,
            constraint=Constraint("json_schema", json.dumps(SCHEMA))),
    ]  # fmt: skip


def test_unconstrained_rows_are_bit_identical_beside_controlled_ones(engine, prompts, monkeypatch):
    """Bit for bit: tokens, logprobs and sampling logprobs. Compaction is off in both runs:
    it cuts the cache columns that are padding for every row left, and which rows are left
    depends on the batch, which moves the attention's sums (and so the logits) by ulps;
    that is the model's forward, not the sampling step."""
    monkeypatch.setattr("treadle.engine.decode.COMPACT_FRACTION", 2.0)
    alone = sample(engine, _plain_requests(prompts))
    plain, ctl = _plain_requests(prompts), _controlled_requests(prompts)
    mixed = sample(engine, [ctl[0], plain[0], plain[1], ctl[1], plain[2], ctl[2]])
    for a, m in zip(alone, [mixed[1], mixed[2], mixed[4]], strict=True):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in m.sequences]
        assert [s.logprobs for s in a.sequences] == [s.logprobs for s in m.sequences]
        assert [s.sampling_logprobs for s in a.sequences] == [
            s.sampling_logprobs for s in m.sequences
        ]
    # and each controlled row samples what it samples alone
    for r, m in zip(_controlled_requests(prompts), [mixed[0], mixed[3], mixed[5]], strict=True):
        one = sample(engine, [r])[0]
        assert [s.tokens for s in one.sequences] == [s.tokens for s in m.sequences]


def test_the_sampling_step_leaves_other_rows_alone(engine):
    """One step on fixed logits: the rows without controls pick the same tokens, with the
    same bits, whether the controlled rows are in the batch or not."""
    gen = torch.Generator().manual_seed(0)
    V = engine.vocab_size
    logits = torch.randn(6, V, generator=gen) * 3  # (6, V)
    u = torch.rand(6, generator=gen)
    spec = SampleSpec(logit_bias={1: 50.0}, repetition_penalty=2.0, presence_penalty=1.0)
    ctl = RowControls(spec, [1, 2, 3], V, logits.device)
    ctl.counts[7] = 2  # as if token 7 was sampled twice
    rows = [1, 4]
    x = controlled_logits(logits, rows, [ctl, ctl.copy()])
    greedy = torch.tensor([False, False, True, False, False, False])
    temp = torch.tensor([1.0, 0.7, 1.0, 1.3, 1.0, 0.5])
    top_k, top_p = torch.full((6,), V), torch.tensor([1.0, 1.0, 1.0, 0.9, 1.0, 1.0])
    min_p = torch.tensor([0.0, 0.1, 0.0, 0.0, 0.0, 0.0])
    tok, lp, _ = pick_tokens(logits, greedy, temp, top_k, top_p, u, controlled=x, min_p=min_p)
    keep = torch.tensor([0, 2, 3, 5])
    tok2, lp2, _ = pick_tokens(
        logits[keep], greedy[keep], temp[keep], top_k[keep], top_p[keep], u[keep],
        min_p=min_p[keep],
    )  # fmt: skip
    assert torch.equal(tok[keep], tok2) and torch.equal(lp[keep], lp2)
    assert torch.equal(x[keep], logits[keep])  # the raw rows untouched, the input unchanged
    assert int(tok[1]) == 1  # the +50 bias wins


# ---- refusals ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (dict(min_p=1.5), "min_p"),
        (dict(min_p=float("nan")), "min_p"),
        (dict(presence_penalty=3.0), "presence_penalty"),
        (dict(frequency_penalty=-2.5), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(logit_bias={10**6: 1.0}), "logit_bias"),
        (dict(logit_bias={5: 101.0}), r"logit_bias\[5\]"),
        (dict(logit_bias={t: 1.0 for t in range(1025)}), "logit_bias has 1025 entries"),
        (dict(constraint=Constraint("regex", "a(b")), "regex"),
        (dict(constraint=Constraint("json_schema", "{not json")), "json_schema"),
        (dict(constraint=Constraint("json_schema", "[1, 2]")), "json_schema"),
        (dict(constraint=Constraint("grammar", "start: foo")), "grammar"),
        (dict(constraint=Constraint("regex", "a" * 70_000)), "over the limit"),
        (dict(constraint=Constraint("xml", "<a/>")), "unknown constraint kind"),
    ],
)
def test_bad_controls_are_refused_naming_the_field(engine, change, field):
    bad = SampleRequest(prompt=[1, 2, 3], params=SampleSpec(max_tokens=2, **change))
    with pytest.raises(InvalidRequestError, match=field):
        sample(engine, [req([1, 2, 3], max_tokens=2), bad])
