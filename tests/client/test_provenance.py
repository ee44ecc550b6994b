"""gspo and stable_reinforce through the treadle SDK against a real server: sampling with
record_stability_info, provenance naming the recorded sequences, and the refusals (missing,
unrecorded, foreign, not matching), each a 400 naming the field.

    .venv/bin/python -m pytest -q tests/client/test_provenance.py
"""

from __future__ import annotations

import numpy as np
import pytest

from treadle import (
    AdamParams,
    Datum,
    ModelInput,
    PromptProvenanceSpan,
    SampledProvenanceSpan,
    SamplingParams,
    ServiceClient,
)
from treadle.client.errors import BadRequestError

TINY = "treadle/tiny-llama"
WAIT = 120
PROMPT = [5, 17, 33, 2, 40, 41]


def rl_datum(prompt: list[int], seq, advantage: float) -> Datum:
    """The usual layout: prompt positions carry advantage 0, sampled ones the advantage."""
    tokens, n = prompt + seq.tokens, len(prompt)
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "logprobs": [0.0] * (n - 1) + seq.logprobs,
            "advantages": [0.0] * (n - 1) + [advantage] * len(seq.tokens),
        },
    )


def with_provenance(datum: Datum, prompt_len: int, seq) -> Datum:
    """As tinker-cookbook's rl_loop names the sampled sequence behind every position."""
    sid, k = seq.sequence_id, len(seq.tokens)
    return datum.with_provenance(
        [
            PromptProvenanceSpan(sequence_id=sid, length=prompt_len),
            SampledProvenanceSpan(sequence_id=sid, length=k - 1),
        ],
        [
            PromptProvenanceSpan(sequence_id=sid, offset=1, length=prompt_len - 1),
            SampledProvenanceSpan(sequence_id=sid, length=k),
        ],
    )


def sample_group(sc, n: int = 4):
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=3, stop=[])
    return sc.sample(PROMPT, num_samples=n, sampling_params=params).result(WAIT).sequences


def stable_reinforce_loss(out, datums, seqs, kl_coeff: float = 0.1) -> float:
    """The loss recomputed from the trainer's logprobs and the sampler's (recorded) ones."""
    total = 0.0
    for row, d, seq in zip(out.loss_fn_outputs, datums, seqs, strict=True):
        lp = row["logprobs"].to_numpy().astype(np.float64)[len(PROMPT) - 1 :]
        q = np.asarray(seq.logprobs, np.float64)
        adv = d.loss_fn_inputs["advantages"].to_numpy()[len(PROMPT) - 1 :]
        rho = np.exp(lp - q)
        total += float((-np.minimum(rho, 1.0) * adv * lp + kl_coeff * (rho - 1 - (lp - q))).sum())
    return total


@pytest.fixture
def svc(server_url):
    with ServiceClient(base_url=server_url) as svc:
        yield svc


def test_stable_reinforce_on_recorded_sequences(svc):
    tc = svc.create_lora_training_client(TINY, rank=8, seed=1)
    sc = tc.save_weights_and_get_sampling_client(record_stability_info=True)
    seqs = sample_group(sc)
    assert all(s.sequence_id for s in seqs)
    advantages = np.linspace(-1, 1, len(seqs))
    datums = [
        with_provenance(rl_datum(PROMPT, s, float(a)), len(PROMPT), s)
        for s, a in zip(seqs, advantages, strict=True)
    ]
    out = tc.forward_backward(datums, loss_fn="stable_reinforce").result(WAIT)
    want = stable_reinforce_loss(out, datums, seqs)
    assert out.metrics["loss:sum"] == pytest.approx(want, rel=1e-4, abs=1e-4)
    tc.optim_step(AdamParams(learning_rate=1e-2)).result(WAIT)
    # after the step the same sequences are off-policy: the recorded logprobs still serve,
    # and kl_coeff weighs the pull back to the sampler
    out = tc.forward(datums, "stable_reinforce", {"kl_coeff": 0.5}).result(WAIT)
    assert out.metrics["loss:sum"] == pytest.approx(
        stable_reinforce_loss(out, datums, seqs, 0.5), rel=1e-4, abs=1e-4
    )


def test_provenance_refusals_name_the_field(svc, server_url):
    tc = svc.create_lora_training_client(TINY, rank=8, seed=2)
    recorded = sample_group(tc.save_weights_and_get_sampling_client(record_stability_info=True))
    plain = sample_group(tc.save_weights_and_get_sampling_client())
    seq = recorded[0]
    good = with_provenance(rl_datum(PROMPT, seq, 1.0), len(PROMPT), seq)

    def refused(datum: Datum, message: str, client=tc) -> None:
        with pytest.raises(BadRequestError) as err:
            client.forward_backward([datum], loss_fn="stable_reinforce").result(WAIT)
        assert message in str(err.value), str(err.value)

    refused(rl_datum(PROMPT, seq, 1.0), "data[0].loss_fn_input_spans: stable_reinforce needs")
    unrecorded = with_provenance(rl_datum(PROMPT, plain[0], 1.0), len(PROMPT), plain[0])
    refused(unrecorded, "data[0].loss_fn_input_spans[0].sequence_id: ")
    refused(unrecorded, "is not a sequence this server recorded for you")
    # a target that is not the token the span names
    tampered = good.model_copy(deep=True)
    targets = tampered.loss_fn_inputs["target_tokens"]
    targets.data[-1] = (targets.data[-1] + 1) % 50
    refused(tampered, f"loss_fn_inputs['target_tokens'][{len(targets.data) - 1}] is token")
    # spans that do not tile the targets
    short = good.model_copy(update={"loss_fn_input_spans": good.loss_fn_input_spans[:1]})
    refused(short, "data[0].loss_fn_input_spans: the spans cover")
    # advantages on prompt positions have no recorded sampler logprob to train against
    prompt_adv = good.model_copy(deep=True)
    prompt_adv.loss_fn_inputs["advantages"].data[0] = 1.0
    refused(prompt_adv, "loss_fn_inputs['advantages'][0] is 1 at a position whose target")
    # another session (another ServiceClient) may not train on this session's samples
    with ServiceClient(base_url=server_url) as other:
        tc_other = other.create_lora_training_client(TINY, rank=8)
        refused(good, "was sampled by another session", client=tc_other)
    # every refusal filled its seq_id: the client's later calls still run, in order
    out = tc.forward_backward([good], loss_fn="stable_reinforce").result(WAIT)
    assert np.isfinite(out.metrics["loss:sum"])


def test_gspo_with_and_without_a_ratio_mask(svc):
    tc = svc.create_lora_training_client(TINY, rank=8, seed=3)
    seqs = sample_group(tc.create_sampling_client())
    advantages = np.linspace(-1, 1, len(seqs))
    tc.forward_backward([rl_datum(PROMPT, s, 1.0) for s in seqs], "importance_sampling")
    tc.optim_step(AdamParams(learning_rate=5e-2)).result(WAIT)  # the samples are off-policy now
    n = len(PROMPT) - 1
    datums, masked = [], []
    for s, a in zip(seqs, advantages, strict=True):
        d = rl_datum(PROMPT, s, float(a))
        datums.append(d)
        mask = d.loss_fn_inputs["advantages"].model_copy(
            update={"data": [0.0] * n + [1.0] * len(s.tokens)}
        )
        masked.append(d.model_copy(update={"loss_fn_inputs": {**d.loss_fn_inputs}}))
        masked[-1].loss_fn_inputs["sequence_ratio_mask"] = mask
    out = tc.forward(datums, "gspo").result(WAIT)  # no mask: the nonzero advantages
    out_masked = tc.forward(masked, "gspo", {"clip_low_threshold": 0.9}).result(WAIT)
    ratios = []
    for result, lo in ((out, 0.8), (out_masked, 0.9)):
        want = 0.0
        for row, d in zip(result.loss_fn_outputs, datums, strict=True):
            lp = row["logprobs"].to_numpy().astype(np.float64)[n:]
            s = d.loss_fn_inputs["logprobs"].to_numpy()[n:]
            adv = d.loss_fn_inputs["advantages"].to_numpy()[n:]
            ratio = np.exp(np.mean(lp - s))  # the sequence's value for every token
            ratios.append(ratio)
            want += float(-np.minimum(ratio * adv, np.clip(ratio, lo, 1.2) * adv).sum())
        assert result.metrics["loss:sum"] == pytest.approx(want, rel=1e-4, abs=1e-4)
    assert max(abs(r - 1) for r in ratios) > 1e-2, ratios  # the ratios are not all 1


def test_weights_are_metered_like_any_model_input(svc):
    """Train tokens count the model input, whatever its weights (a masked prompt too)."""
    tc = svc.create_lora_training_client(TINY, rank=8, seed=4)
    seqs = sample_group(tc.save_weights_and_get_sampling_client(record_stability_info=True))
    n = len(PROMPT) - 1
    weighted = []
    for s in seqs:
        d = rl_datum(PROMPT, s, 1.0)
        weights = [0.0] * n + [1.0] * len(s.tokens)
        d.loss_fn_inputs["weights"] = d.loss_fn_inputs["advantages"].model_copy(
            update={"data": weights}
        )
        weighted.append(with_provenance(d, len(PROMPT), s))

    def train_tokens() -> int:
        rows = svc.get_usage(by="session")["rows"]
        return sum(r["train_tokens"] for r in rows if r["key"] == svc.session_id)

    before = train_tokens()
    for loss in ("ppo", "gspo", "stable_reinforce"):
        tc.forward_backward(weighted, loss_fn=loss).result(WAIT)
    sent = sum(d.model_input.length for d in weighted)
    assert train_tokens() - before == 3 * sent
