"""The treadle SDK against a real `treadle serve` process on a tiny Llama.

Results are checked against independent computations: the PPO loss against its formula from
the returned logprobs, trainer logprobs against the sampler's for the same weights, a custom
loss's step against the built-in cross-entropy's, and saved checkpoints against the live model.

    .venv/bin/python -m pytest -q tests/client/test_sdk_server.py
"""

from __future__ import annotations

import numpy as np
import pytest
from _proxy import FaultProxy

from treadle import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient
from treadle.client.errors import BadRequestError, NotFoundError
from treadle.client.transport import RetryPolicy

torch = pytest.importorskip("torch")

TINY = "treadle/tiny-llama"  # the name tests/conftest.py serves the tiny model under
FAST_RETRY = RetryPolicy(initial_backoff_s=0.01, max_backoff_s=0.1, deadline_s=20)
WAIT = 120  # seconds any single result may take on a busy 2-core machine
ATOL = 2e-3  # sampler vs trainer logprobs: same weights, different batch shapes


def ce_datum(tokens: list[int], weights: np.ndarray) -> Datum:
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights.astype(np.float32)},
    )


def random_data(vocab: int, seed: int, n: int = 3, length: int = 12) -> list[Datum]:
    rng = np.random.default_rng(seed)
    return [
        ce_datum(rng.integers(0, vocab, length).tolist(), rng.random(length - 1)) for _ in range(n)
    ]


def logprobs_of(out) -> list[np.ndarray]:
    return [row["logprobs"].to_numpy() for row in out.loss_fn_outputs]


def vocab_size(svc: ServiceClient) -> int:
    return len(svc.get_tokenizer(TINY))


def ppo_loss(lp: np.ndarray, s: np.ndarray, adv: np.ndarray, lo=0.8, hi=1.2) -> float:
    r = np.exp(lp.astype(np.float64) - s)
    return float(-np.minimum(r * adv, np.clip(r, lo, hi) * adv).sum())


def test_rl_loop_through_the_service(server_url):
    svc = ServiceClient(base_url=server_url, api_key="tml-test")
    assert TINY in [m.model_name for m in svc.list_base_models()]
    tc = svc.create_lora_training_client(TINY, training_session_name="run-1", rank=8, alpha=16)
    assert tc.get_info().model_data.model_name == TINY
    tok = tc.get_tokenizer()
    questions = ["1+2=", "3+4=", "5+1=", "2+2="]
    params = SamplingParams(max_tokens=8, temperature=0.7, top_p=0.9, seed=0)
    probe = tok.encode("12+34=46")
    probe_lps = []
    sc = tc.create_sampling_client()  # the session's current weights, as in the loop
    for _step in range(3):
        # all sampling requests in flight before the first wait
        futs = [
            (q, sc.sample(tok.encode(q), num_samples=4, sampling_params=params)) for q in questions
        ]
        probe_fut = sc.compute_logprobs(probe)
        datums, inputs = [], []
        for q, fut in futs:
            prompt, result = tok.encode(q), fut.result(WAIT)
            assert len(result.sequences) == 4
            # a synthetic reward that varies between samples, so advantages are not all zero
            rewards = np.array([sum(s.tokens) % 10 / 10 for s in result.sequences])
            advantages = rewards - rewards.mean()  # group-relative
            for seq, a in zip(result.sequences, advantages, strict=True):
                assert 1 <= len(seq.tokens) <= 8 and len(seq.logprobs) == len(seq.tokens)
                full = prompt + seq.tokens
                s = np.array([0.0] * (len(prompt) - 1) + seq.logprobs, dtype=np.float32)
                adv = np.array([0.0] * (len(prompt) - 1) + [a] * len(seq.tokens), np.float32)
                datums.append(
                    Datum(
                        model_input=ModelInput.from_ints(full[:-1]),
                        loss_fn_inputs={
                            "target_tokens": full[1:],
                            "logprobs": s,
                            "advantages": adv,
                        },
                    )
                )
                inputs.append((len(prompt) - 1, s, adv))
        fb = tc.forward_backward(datums, loss_fn="ppo")
        op = tc.optim_step(AdamParams(learning_rate=1e-3))  # sent before fb completes
        out = fb.result(WAIT)
        op.result(WAIT)
        want = 0.0
        for (n_prompt, s, adv), lp in zip(inputs, logprobs_of(out), strict=True):
            # the sampler scored these tokens with the same weights the trainer just used
            np.testing.assert_allclose(lp[n_prompt:], s[n_prompt:], atol=ATOL)
            want += ppo_loss(lp, s, adv)
        assert out.metrics["loss:sum"] == pytest.approx(want, rel=1e-4, abs=1e-4)
        probe_lps.append(np.array(probe_fut.result(WAIT)[1:], dtype=np.float32))
        sc = tc.save_weights_and_get_sampling_client()
    assert np.abs(probe_lps[0] - probe_lps[2]).max() > 1e-4, "the policy did not move"

    sampler_path = tc.save_weights_for_sampler("final").result(WAIT).path
    state_path = tc.save_state("final").result(WAIT).path
    assert sampler_path.startswith("tinker://") and sampler_path.endswith("/sampler_weights/final")
    assert state_path.startswith("tinker://") and state_path.endswith("/weights/final")
    probe_datum = ce_datum(probe, np.ones(len(probe) - 1))
    live = logprobs_of(tc.forward([probe_datum]).result(WAIT))[0]
    saved = svc.create_sampling_client(model_path=sampler_path).compute_logprobs(probe)
    np.testing.assert_allclose(np.array(saved.result(WAIT)[1:], np.float32), live, atol=ATOL)
    with svc.create_training_client_from_state(state_path) as restored:
        again = logprobs_of(restored.forward([probe_datum]).result(WAIT))[0]
    np.testing.assert_allclose(again, live, atol=1e-5)
    tc.stop()
    with pytest.raises(RuntimeError, match="stopped"):
        tc.forward([probe_datum])


def test_custom_loss_takes_the_same_step_as_cross_entropy(server_url):
    adam = AdamParams(learning_rate=1e-2)
    with (
        ServiceClient(base_url=server_url) as svc_a,
        ServiceClient(base_url=server_url) as svc_b,
    ):
        data = random_data(vocab_size(svc_a), seed=1)
        tc_a = svc_a.create_lora_training_client(TINY, rank=8, seed=7)
        tc_b = svc_b.create_lora_training_client(TINY, rank=8, seed=7)
        before = logprobs_of(tc_a.forward(data).result(WAIT))

        def weighted_nll(data, logprobs):
            loss = sum(
                -(torch.from_numpy(d.loss_fn_inputs["weights"].to_numpy()) * lp).sum()
                for d, lp in zip(data, logprobs, strict=True)
            )
            return loss, {"n:sum": float(len(data))}

        ce = tc_a.forward_backward(data, "cross_entropy")
        tc_a.optim_step(adam)
        custom = tc_b.forward_backward_custom(data, weighted_nll)
        tc_b.optim_step(adam)
        after_a = logprobs_of(tc_a.forward(data).result(WAIT))
        after_b = logprobs_of(tc_b.forward(data).result(WAIT))
        ce_out, custom_out = ce.result(WAIT), custom.result(WAIT)
    assert custom_out.metrics["loss:sum"] == pytest.approx(ce_out.metrics["loss:sum"], rel=1e-5)
    assert custom_out.metrics["surrogate_loss:sum"] == pytest.approx(
        ce_out.metrics["loss:sum"], rel=1e-5
    )
    assert custom_out.metrics["n:sum"] == 3
    for a, b, b0 in zip(after_a, after_b, before, strict=True):
        np.testing.assert_allclose(b, a, atol=1e-5)
        assert np.abs(a - b0).max() > 1e-4, "the optimizer step changed nothing"


def test_retried_submits_run_once(server_url):
    """A forward_backward whose reply is lost (connection reset after the server ran it) is
    re-sent and not run again; a 503 before the server sees an optim_step is retried.

    d2 carries -1.5x d1's weights, so one run of d1 plus d2 gives gradient -0.5 g1 while a
    doubled d1 gives +0.5 g1: Adam's first step then moves every weight the other way."""
    adam = AdamParams(learning_rate=1e-2)
    port = int(server_url.rsplit(":", 1)[1])
    with ServiceClient(base_url=server_url) as probe_svc:
        vocab = vocab_size(probe_svc)
    d1 = random_data(vocab, seed=2)
    d2 = [
        Datum(
            model_input=d.model_input,
            loss_fn_inputs={
                "target_tokens": d.loss_fn_inputs["target_tokens"],
                "weights": -1.5 * d.loss_fn_inputs["weights"].to_numpy(),
            },
        )
        for d in d1
    ]

    def train(url: str, batches: list[list[Datum]]) -> list[np.ndarray]:
        with ServiceClient(base_url=url, retry=FAST_RETRY) as svc:
            tc = svc.create_lora_training_client(TINY, rank=8, seed=11)
            futs = [tc.forward_backward(b) for b in batches]
            op = tc.optim_step(adam)
            for f in futs:
                f.result(WAIT)
            op.result(WAIT)
            return logprobs_of(tc.forward(d1).result(WAIT))

    with FaultProxy(port) as proxy:
        proxy.add_rule("/api/v1/forward_backward", "reset_after")
        proxy.add_rule("/api/v1/optim_step", "503")
        faulty = train(proxy.url, [d1, d2])
        assert proxy.fired("/api/v1/forward_backward")[:2] == ["reset_after", "forward"]
        assert proxy.fired("/api/v1/optim_step") == ["503", "forward"]
    clean = train(server_url, [d1, d2])
    doubled = train(server_url, [d1, d1, d2])
    for f, c, d in zip(faulty, clean, doubled, strict=True):
        np.testing.assert_allclose(f, c, atol=1e-6)
        assert np.abs(d - c).max() > 1e-3, "a doubled run must be visible in this setup"


def test_bad_requests_raise_typed_errors_and_the_client_keeps_working(server_url):
    with ServiceClient(base_url=server_url) as svc:
        vocab = vocab_size(svc)
        with pytest.raises((BadRequestError, NotFoundError)) as missing:
            svc.create_lora_training_client("no/such-model")
        assert "no/such-model" in missing.value.message
        tc = svc.create_lora_training_client(TINY, rank=8)
        good = random_data(vocab, seed=3, n=1)
        bad = [ce_datum([1, 2, vocab + 5, 3], np.ones(3))]
        with pytest.raises(BadRequestError) as err:
            tc.forward_backward(bad).result(WAIT)
        assert str(vocab + 5) in err.value.message, err.value.message
        with pytest.raises(BadRequestError) as ppo_err:
            tc.forward_backward(good, loss_fn="ppo").result(WAIT)
        assert "ppo needs 'logprobs'" in ppo_err.value.message, ppo_err.value.message
        # later ops of the same model still run (the failed ones did not leave a gap)
        out = tc.forward_backward(good).result(WAIT)
        tc.optim_step().result(WAIT)
        assert len(out.loss_fn_outputs) == 1
        sc = tc.save_weights_and_get_sampling_client()
        with pytest.raises(BadRequestError):
            sc.sample([vocab + 1], sampling_params=SamplingParams(max_tokens=2)).result(WAIT)
        assert (
            len(
                sc.sample([1, 2], sampling_params=SamplingParams(max_tokens=2))
                .result(WAIT)
                .sequences
            )
            == 1
        )


def test_tokenizer_comes_from_the_server(server_url, tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    from treadle.client import tokenizer

    tokenizer._memo.clear()  # fetch for real, into this test's cache folder
    with ServiceClient(base_url=server_url) as svc:
        tok = svc.get_tokenizer(TINY)
    ref = AutoTokenizer.from_pretrained(tiny_model_dir)
    for text in ["12+34=46", "What is 7*8?", "hello world"]:
        assert tok.encode(text) == ref.encode(text)
    chat = [{"role": "user", "content": "1+1="}]
    assert tok.apply_chat_template(chat, tokenize=False) == ref.apply_chat_template(
        chat, tokenize=False
    )
    (folder,) = (tmp_path / "cache" / "tokenizers" / "treadle" / "tiny-llama").iterdir()
    assert (folder / "tokenizer.json").is_file()
