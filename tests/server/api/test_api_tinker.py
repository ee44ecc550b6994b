"""The official tinker SDK (0.38), unmodified, against a real `treadle serve` process.

Numbers are checked against plain transformers (and peft) loading the same folders: the
logprobs of a fresh adapter are the base model's, losses follow their formulas, a sampler
scores like its trainer, a saved adapter loads in peft, saved optimizer state resumes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

tinker = pytest.importorskip("tinker")
from tinker import types as T  # noqa: E402

API_KEY = "tml-treadle-tests"


@pytest.fixture(scope="module")
def plain(plain_model):
    return plain_model


def plain_lp(model, tokens: list[int], targets: list[int]) -> np.ndarray:
    logits = model(input_ids=torch.tensor([tokens])).logits[0].float()  # (T, V)
    logp = logits.log_softmax(-1)
    return logp[torch.arange(len(tokens)), torch.tensor(targets)].numpy()  # (T,)


def make_data(rng, vocab: int, lengths: list[int], **extra_fn) -> list[T.Datum]:
    data = []
    for T_ in lengths:
        seq = rng.integers(0, vocab, T_ + 1).tolist()
        inputs = {"target_tokens": seq[1:]}
        for key, fn in extra_fn.items():
            inputs[key] = fn(T_)
        data.append(T.Datum(model_input=T.ModelInput.from_ints(seq[:-1]), loss_fn_inputs=inputs))
    return data


def lps(out) -> list[np.ndarray]:
    return [o["logprobs"].to_numpy() for o in out.loss_fn_outputs]


@pytest.fixture
def service(treadle_server):
    sc = tinker.ServiceClient(base_url=treadle_server.url, api_key=API_KEY)
    yield sc
    sc.close("success").result(timeout=30)


def test_training_sampling_and_checkpoints(service, treadle_server, plain, tmp_path):
    name = treadle_server.model_name
    vocab = plain.config.vocab_size
    tc = service.create_lora_training_client(base_model=name, rank=4, seed=0).result()
    info = tc.get_info()
    assert info.model_data.model_name == name and info.model_data.tokenizer_id == name
    assert info.lora_rank == 4 and tc.model_id.endswith(":train:0")

    rng = np.random.default_rng(0)
    data = make_data(rng, vocab, [7, 12], weights=lambda n: rng.uniform(0.1, 1, n).tolist())
    ref = [
        plain_lp(plain, d.model_input.to_ints(), d.loss_fn_inputs["target_tokens"].tolist())
        for d in data
    ]
    want_loss = -sum(
        float((r * d.loss_fn_inputs["weights"].to_numpy()).sum())
        for r, d in zip(ref, data, strict=True)
    )

    # a fresh adapter is the base model: logprobs and loss from plain transformers
    fwd = tc.forward(data, "cross_entropy").result()
    for got, want in zip(lps(fwd), ref, strict=True):
        np.testing.assert_allclose(got, want, atol=2e-4)
    assert fwd.metrics["loss:sum"] == pytest.approx(want_loss, rel=1e-4)
    fb = tc.forward_backward(data, "cross_entropy").result()
    assert fb.metrics["loss:sum"] == pytest.approx(want_loss, rel=1e-4)
    step = tc.optim_step(T.AdamParams(learning_rate=1e-2)).result()
    assert step.metrics is not None
    after = tc.forward(data, "cross_entropy").result()
    assert after.metrics["loss:sum"] < want_loss  # one step of descent on the same batch

    # the sampler scores exactly like its trainer (same weights, other code path)
    sampler = tc.save_weights_and_get_sampling_client().result()
    d0 = data[0]
    full = d0.model_input.to_ints() + [int(d0.loss_fn_inputs["target_tokens"].tolist()[-1])]
    scored = sampler.compute_logprobs(T.ModelInput.from_ints(full)).result()
    assert scored[0] is None
    np.testing.assert_allclose(scored[1:], lps(after)[0], atol=2e-4)

    res = sampler.sample(
        T.ModelInput.from_ints(full[:4]), 3, T.SamplingParams(max_tokens=6, seed=3)
    ).result()
    assert len(res.sequences) == 3
    assert len({s.sequence_id for s in res.sequences}) == 3
    for s in res.sequences:
        assert 1 <= len(s.tokens) <= 6 and all(0 <= t < vocab for t in s.tokens)
        assert len(s.logprobs) == len(s.tokens) and s.stop_reason in ("stop", "length")

    # checkpoints: a PEFT adapter peft loads, and a training state that resumes exactly
    state_path = tc.save_state("step-1").result().path
    assert state_path.startswith("tinker://") and state_path.endswith("/weights/step-1")
    sampler_path = tc.save_weights_for_sampler("step-1").result().path
    assert sampler_path.endswith("/sampler_weights/step-1")
    run_id = sampler_path.split("/")[2]
    adapter_dir = treadle_server.data_dir / "artifacts" / run_id / "sampler_weights" / "step-1"
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(treadle_server_model_dir(treadle_server))
    peft_model = PeftModel.from_pretrained(base, adapter_dir).eval()
    with torch.no_grad():
        peft_lp = plain_lp(
            peft_model, d0.model_input.to_ints(), d0.loss_fn_inputs["target_tokens"].tolist()
        )
    np.testing.assert_allclose(peft_lp, lps(after)[0], atol=2e-4)

    from_path = service.create_sampling_client(model_path=sampler_path).result()
    np.testing.assert_allclose(
        from_path.compute_logprobs(T.ModelInput.from_ints(full)).result()[1:], scored[1:], atol=1e-5
    )

    resumed = service.create_training_client_from_state_with_optimizer(state_path).result()
    weights_only = service.create_training_client_from_state(state_path).result()
    np.testing.assert_allclose(
        lps(resumed.forward(data, "cross_entropy").result())[1], lps(after)[1], atol=1e-5
    )
    for client in (tc, resumed, weights_only):
        client.forward_backward(data, "cross_entropy").result()
        client.optim_step(T.AdamParams(learning_rate=1e-2)).result()
    final = [lps(c.forward(data, "cross_entropy").result())[0] for c in (tc, resumed, weights_only)]
    np.testing.assert_allclose(final[1], final[0], atol=1e-5)  # Adam moments came back
    assert np.abs(final[2] - final[0]).max() > 1e-4  # fresh moments take another step

    rest = tinker.RestClient(base_url=treadle_server.url, api_key=API_KEY)
    runs = rest.list_checkpoints(tc.model_id).result()
    assert {c.tinker_path for c in runs.checkpoints} >= {state_path, sampler_path}


def treadle_server_model_dir(server) -> str:
    """The folder the server was started on (from its command line)."""
    arg = next(a for a in server.proc.args if a.startswith(f"{server.model_name}="))
    return arg.split("=", 1)[1]


def test_ppo_loss_matches_its_formula(service, treadle_server, plain):
    vocab = plain.config.vocab_size
    tc = service.create_lora_training_client(base_model=treadle_server.model_name, rank=2).result()
    rng = np.random.default_rng(1)
    data = make_data(rng, vocab, [9, 5], advantages=lambda n: rng.normal(size=n).tolist())
    for d in data:  # sampling logprobs near the learner's, so that some ratios get clipped
        lp = plain_lp(plain, d.model_input.to_ints(), d.loss_fn_inputs["target_tokens"].tolist())
        d.loss_fn_inputs["logprobs"] = T.TensorData.from_numpy(
            (lp + rng.normal(scale=0.3, size=lp.shape)).astype(np.float32)
        )
    lo, hi = 0.9, 1.1
    want = 0.0
    for d in data:
        lp = plain_lp(plain, d.model_input.to_ints(), d.loss_fn_inputs["target_tokens"].tolist())
        r = np.exp(lp - d.loss_fn_inputs["logprobs"].to_numpy())
        A = d.loss_fn_inputs["advantages"].to_numpy()
        want -= float(np.minimum(r * A, np.clip(r, lo, hi) * A).sum())
    out = tc.forward_backward(
        data, "ppo", {"clip_low_threshold": lo, "clip_high_threshold": hi}
    ).result()
    assert out.metrics["loss:sum"] == pytest.approx(want, rel=1e-4, abs=1e-5)
    tc.optim_step(T.AdamParams(learning_rate=1e-3)).result()


def test_greedy_base_sampling_matches_plain_transformers(service, treadle_server, plain):
    sampler = service.create_sampling_client(base_model=treadle_server.model_name).result()
    prompt = [5, 17, 33, 2]
    res = sampler.sample(
        T.ModelInput.from_ints(prompt), 1, T.SamplingParams(max_tokens=8, temperature=0.0, stop=[])
    ).result()
    ids = list(prompt)
    for _ in range(8):
        ids.append(int(plain(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    assert res.sequences[0].tokens == ids[len(prompt) :]
    assert res.sequences[0].stop_reason == "length"


def test_bad_token_is_a_400_and_the_client_keeps_working(service, treadle_server, plain):
    vocab = plain.config.vocab_size
    tc = service.create_lora_training_client(base_model=treadle_server.model_name, rank=2).result()
    bad = T.Datum(
        model_input=T.ModelInput.from_ints([1, vocab + 5]),
        loss_fn_inputs={"target_tokens": [2, 3], "weights": [1.0, 1.0]},
    )
    with pytest.raises(tinker.BadRequestError, match="outside the vocabulary"):
        tc.forward_backward([bad], "cross_entropy").result()
    good = T.Datum(
        model_input=T.ModelInput.from_ints([1, 2]),
        loss_fn_inputs={"target_tokens": [2, 3], "weights": [1.0, 1.0]},
    )
    out = tc.forward_backward([good], "cross_entropy").result()
    assert np.isfinite(out.metrics["loss:sum"])
