"""The protocol corners tinker-cookbook leans on, through the official tinker SDK (0.38).

Prompt and top-K prompt logprobs (compute_logprobs, KL references, distillation), stops that
end up in the returned tokens with their stop_reason, per-sample sequence ids,
forward_backward_custom (DPO), metrics reduced across the SDK's chunks, and the RestClient
lookups the cookbook's checkpoint helpers make. Every number is checked against plain
transformers on the same model folder.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

tinker = pytest.importorskip("tinker")
from tinker import types as T  # noqa: E402

API_KEY = "tml-treadle-compat"


@pytest.fixture(scope="module")
def plain(plain_model):
    return plain_model


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def service(treadle_server):
    sc = tinker.ServiceClient(base_url=treadle_server.url, api_key=API_KEY)
    yield sc
    sc.close("success").result(timeout=30)


def plain_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """(T-1, V) log_softmax at each position predicting the next token."""
    logits = model(input_ids=torch.tensor([tokens])).logits[0, :-1].float()  # (T-1, V)
    return logits.log_softmax(-1)


def test_prompt_logprobs_and_topk(service, treadle_server, plain):
    sampler = service.create_sampling_client(base_model=treadle_server.model_name).result()
    prompt = [5, 17, 33, 2, 40, 41, 7]
    want = plain_logprobs(plain, prompt)  # (T-1, V)
    res = sampler.sample(
        T.ModelInput.from_ints(prompt),
        1,
        T.SamplingParams(max_tokens=1),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=4,
    ).result()
    assert res.prompt_logprobs[0] is None and res.topk_prompt_logprobs[0] is None
    chosen = want.gather(-1, torch.tensor(prompt[1:])[:, None]).squeeze(1)  # (T-1,)
    np.testing.assert_allclose(res.prompt_logprobs[1:], chosen.numpy(), atol=2e-4)
    vals, ids = want.topk(4, dim=-1)  # (T-1, 4)
    for row, v_row, i_row in zip(res.topk_prompt_logprobs[1:], vals, ids, strict=True):
        assert [t for t, _ in row] == i_row.tolist()
        np.testing.assert_allclose([lp for _, lp in row], v_row.numpy(), atol=2e-4)

    # compute_logprobs (reference models in DPO and KL penalties) and its last-N form
    scored = sampler.compute_logprobs(T.ModelInput.from_ints(prompt)).result()
    assert scored[0] is None
    np.testing.assert_allclose(scored[1:], chosen.numpy(), atol=2e-4)
    last = sampler.sample(
        T.ModelInput.from_ints(prompt),
        1,
        T.SamplingParams(max_tokens=1),
        include_prompt_logprobs=True,
        prompt_logprobs_last_n=2,
    ).result()
    assert last.prompt_logprobs[:-2] == [None] * (len(prompt) - 2)
    np.testing.assert_allclose(last.prompt_logprobs[-2:], chosen[-2:].numpy(), atol=2e-4)


def test_stops_are_returned_with_their_reason(service, treadle_server, plain, tokenizer):
    sampler = service.create_sampling_client(base_model=treadle_server.model_name).result()
    mi = T.ModelInput.from_ints([5, 17, 33, 2])
    eos = set(plain.generation_config.eos_token_id)  # EOS ends sampling whenever stops are given

    def run(seed: int, max_tokens: int, stop: list, n: int = 1):
        params = T.SamplingParams(max_tokens=max_tokens, seed=seed, stop=stop)
        return sampler.sample(mi, n, params).result().sequences

    # a seeded run with no stops at all, then the same seed with a stop inside it: the draws
    # are the same, so the second run is the first one cut just after its stop
    for seed in range(50):
        free = run(seed, 10, [])[0].tokens
        # the stop: a token not seen before it, with no EOS before it either
        j = next((i for i in range(2, 10) if free[i] not in free[:i]), None)
        if j is not None and not eos & set(free[: j + 1]):
            break
    by_token = run(seed, 10, [free[j]], n=3)
    first = by_token[0]  # the other samples of a request take other draws
    assert first.tokens == free[: j + 1] and first.stop_reason == "stop"  # the stop is included
    for seq in by_token:
        assert len(seq.logprobs) == len(seq.tokens)
        assert seq.stop_reason == ("stop" if seq.tokens[-1] in eos | {free[j]} else "length")
    assert len({s.sequence_id for s in by_token}) == 3

    # a stop string: the text of that token; sampling ends on the token completing it
    text = tokenizer.decode([free[j]])
    end = next(m for m in range(1, 11) if text in tokenizer.decode(free[:m]))
    by_text = run(seed, 10, [text])[0]
    assert by_text.tokens == free[:end] and by_text.stop_reason == "stop"

    unstopped = run(seed, 4, [])[0]
    assert unstopped.tokens == free[:4] and unstopped.stop_reason == "length"


def test_forward_backward_custom_is_cross_entropy_with_the_loss_gradient(
    service, treadle_server, plain
):
    """A DPO-style nonlinear loss through forward_backward_custom takes the same step as
    cross_entropy with weights = -dL/dlogprobs computed here from plain transformers."""
    name = treadle_server.model_name
    rng = np.random.default_rng(3)
    seqs = [rng.integers(0, plain.config.vocab_size, n).tolist() for n in (9, 7)]
    data = [
        T.Datum(
            model_input=T.ModelInput.from_ints(s[:-1]),
            loss_fn_inputs={"target_tokens": s[1:], "weights": [1.0] * (len(s) - 1)},
        )
        for s in seqs
    ]

    def dpo_like(lp_chosen: torch.Tensor, lp_rejected: torch.Tensor) -> torch.Tensor:
        return -torch.nn.functional.logsigmoid(0.5 * (lp_chosen.sum() - lp_rejected.sum()))

    def loss_fn(batch, logprobs_list):
        loss = dpo_like(logprobs_list[0], logprobs_list[1])
        return loss, {"dpo_loss": float(loss.detach())}

    custom = service.create_lora_training_client(base_model=name, rank=4, seed=11).result()
    out = custom.forward_backward_custom(data, loss_fn).result()

    lps = [
        plain_logprobs(plain, s).gather(-1, torch.tensor(s[1:])[:, None]).squeeze(1) for s in seqs
    ]
    lps = [lp.clone().requires_grad_(True) for lp in lps]
    want = dpo_like(*lps)
    want.backward()
    assert out.metrics["dpo_loss"] == pytest.approx(float(want), rel=1e-4)

    manual = service.create_lora_training_client(base_model=name, rank=4, seed=11).result()
    weighted = [
        T.Datum(
            model_input=d.model_input,
            loss_fn_inputs={
                "target_tokens": d.loss_fn_inputs["target_tokens"],
                "weights": T.TensorData.from_numpy((-lp.grad).numpy().astype(np.float32)),
            },
        )
        for d, lp in zip(data, lps, strict=True)
    ]
    manual.forward_backward(weighted, "cross_entropy").result()
    for client in (custom, manual):
        client.optim_step(T.AdamParams(learning_rate=1e-2)).result()
    after = [
        [
            o["logprobs"].to_numpy()
            for o in c.forward(data, "cross_entropy").result().loss_fn_outputs
        ]
        for c in (custom, manual)
    ]
    for a, b, before in zip(after[0], after[1], lps, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
        assert np.abs(a - before.detach().numpy()).max() > 1e-4  # the step did move them


def test_metrics_are_reduced_across_the_sdks_chunks(service, treadle_server, plain):
    """Over 1024 datums the SDK splits a batch into chunks and reduces `loss:sum` by its
    suffix; the total and the per-datum order must match one plain forward."""
    tc = service.create_lora_training_client(base_model=treadle_server.model_name, rank=2).result()
    rng = np.random.default_rng(5)
    n = 1100
    seqs = rng.integers(0, plain.config.vocab_size, (n, 4))  # (n, 4)
    weights = rng.uniform(0, 1, (n, 3)).astype(np.float32)  # (n, 3)
    data = [
        T.Datum(
            model_input=T.ModelInput.from_ints(seqs[i, :-1].tolist()),
            loss_fn_inputs={"target_tokens": seqs[i, 1:].tolist(), "weights": weights[i].tolist()},
        )
        for i in range(n)
    ]
    out = tc.forward(data, "cross_entropy").result()
    logits = plain(input_ids=torch.tensor(seqs[:, :-1])).logits.float()  # (n, 3, V)
    want = logits.log_softmax(-1).gather(-1, torch.tensor(seqs[:, 1:])[..., None])[..., 0]
    got = np.stack([o["logprobs"].to_numpy() for o in out.loss_fn_outputs])  # (n, 3)
    np.testing.assert_allclose(got, want.numpy(), atol=2e-4)
    assert out.metrics["loss:sum"] == pytest.approx(-(want.numpy() * weights).sum(), rel=1e-4)
    assert all(k.count(":") == 1 for k in out.metrics)


def test_rest_lookups_the_cookbook_makes(service, treadle_server):
    """checkpoint_utils: the renderer name stored in user_metadata is read back through
    get_training_run_by_tinker_path on resume; weights_info names the base model."""
    name = treadle_server.model_name
    tc = service.create_lora_training_client(
        base_model=name, rank=3, user_metadata={"renderer_name": "qwen3_instruct"}
    ).result()
    state = tc.save_state("ckpt").result().path
    sampler_path = tc.save_weights_for_sampler("ckpt").result().path
    rest = tinker.RestClient(base_url=treadle_server.url, api_key=API_KEY)
    run = rest.get_training_run_by_tinker_path(state).result()
    assert run.base_model == name and run.lora_rank == 3
    assert (run.user_metadata or {}).get("renderer_name") == "qwen3_instruct"
    info = rest.get_weights_info_by_tinker_path(state).result()
    assert info.base_model == name and info.lora_rank == 3
    listed = {
        c.tinker_path for c in rest.list_checkpoints(run.training_run_id).result().checkpoints
    }
    assert {state, sampler_path} <= listed
    runs = rest.list_training_runs(limit=100).result().training_runs
    assert run.training_run_id in {r.training_run_id for r in runs}
    # create_sampling_client(model_path=...) scores like the trainer that saved it
    sampler = service.create_sampling_client(model_path=sampler_path).result()
    tokens = [3, 9, 27, 17]
    scored = sampler.compute_logprobs(T.ModelInput.from_ints(tokens)).result()
    datum = T.Datum(
        model_input=T.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 3},
    )
    trained = tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
    np.testing.assert_allclose(scored[1:], trained.to_numpy(), atol=1e-4)
    assert math.isfinite(sum(scored[1:]))


def test_target_prompt_logprobs_sample_topk_and_alt_tokens(service, treadle_server, plain):
    """target_prompt_logprobs (the cookbook's decisions recipe), dense and sparse CSR;
    topk_sample_logprobs; prompt_alt_tokens_k. Against plain transformers."""
    sampler = service.create_sampling_client(base_model=treadle_server.model_name).result()
    prompt = [5, 17, 33, 2, 40, 41, 7]
    mi = T.ModelInput.from_ints(prompt)
    want = plain_logprobs(plain, prompt)  # (P-1, V)
    rng = np.random.default_rng(7)
    ids = rng.integers(0, plain.config.vocab_size, (len(prompt) - 1, 3))  # (P-1, 3)
    ids[1, 2] = ids[4, 0] = -1
    expect = want.gather(-1, torch.tensor(ids).clamp(min=0)).masked_fill(torch.tensor(ids) < 0, 0)
    dense = sampler.sample(
        mi, 1, T.SamplingParams(max_tokens=1), target_prompt_logprobs=T.TensorData.from_numpy(ids)
    ).result()
    np.testing.assert_allclose(dense.target_prompt_logprobs.to_numpy(), expect.numpy(), atol=2e-4)

    sparse_ids = torch.full((len(prompt) - 1, 4), -1, dtype=torch.int64)
    sparse_ids[3] = torch.tensor([9, 2, 100, 7])  # one scored position, as decisions does
    sparse = T.TensorData.from_torch_sparse(sparse_ids, pad_value=-1)
    assert sparse.sparse_crow_indices is not None
    got = sampler.sample(
        mi, 1, T.SamplingParams(max_tokens=1), target_prompt_logprobs=sparse
    ).result()
    got_np = got.target_prompt_logprobs.to_numpy()
    np.testing.assert_allclose(got_np[3], want[3, [9, 2, 100, 7]].numpy(), atol=2e-4)
    assert not np.delete(got_np, 3, axis=0).any()

    res = sampler.sample(
        mi, 1, T.SamplingParams(max_tokens=5, seed=4, stop=[]), topk_sample_logprobs=3
    ).result()
    seq = res.sequences[0]
    full = plain_logprobs(plain, prompt + seq.tokens)[len(prompt) - 1 :]  # (5, V)
    vals, top = full.topk(3, dim=-1)
    assert [[t for t, _ in row] for row in seq.topk_logprobs] == top.tolist()
    np.testing.assert_allclose([[v for _, v in r] for r in seq.topk_logprobs], vals, atol=2e-4)

    greedy_alt = sampler.sample(
        mi, 1, T.SamplingParams(max_tokens=1, temperature=0.0), prompt_alt_tokens_k=2
    ).result()
    alt_ids = greedy_alt.prompt_alt_tokens.tokens.to_numpy()
    assert alt_ids.shape == (len(prompt) - 1, 2)
    assert (alt_ids == want.argmax(-1, keepdim=True).numpy()).all()
    drawn = sampler.sample(
        mi, 1, T.SamplingParams(max_tokens=1, seed=1), prompt_alt_tokens_k=4
    ).result()
    d_ids = torch.tensor(drawn.prompt_alt_tokens.tokens.to_numpy())  # (P-1, 4)
    np.testing.assert_allclose(
        drawn.prompt_alt_tokens.logprobs.to_numpy(), want.gather(-1, d_ids).numpy(), atol=2e-4
    )


def test_treadle_sdk_takes_the_same_sampling_options(treadle_server, plain):
    """The project's own SDK sends the same options (tinker's names and positions)."""
    from treadle import SamplingParams, ServiceClient

    prompt = [5, 17, 33, 2, 40, 41, 7]
    want = plain_logprobs(plain, prompt)  # (P-1, V)
    ids = np.tile(np.arange(3), (len(prompt) - 1, 1))  # (P-1, 3)
    ids[2] = -1
    with ServiceClient(base_url=treadle_server.url, api_key=API_KEY) as svc:
        sampler = svc.create_sampling_client(base_model=treadle_server.model_name)
        res = sampler.sample(
            prompt,
            2,
            SamplingParams(max_tokens=3, seed=2),
            include_prompt_logprobs=True,
            topk_sample_logprobs=2,
            target_prompt_logprobs=ids,
            prompt_logprobs_last_n=3,
        ).result()
        last = sampler.compute_logprobs(prompt, prompt_logprobs_last_n=2).result()
    expect = want[:, :3].masked_fill(torch.tensor(ids) < 0, 0)
    np.testing.assert_allclose(res.target_prompt_logprobs.to_numpy(), expect.numpy(), atol=2e-4)
    chosen = want.gather(-1, torch.tensor(prompt[1:])[:, None]).squeeze(1).numpy()
    assert res.prompt_logprobs[:-3] == [None] * (len(prompt) - 3)
    np.testing.assert_allclose(res.prompt_logprobs[-3:], chosen[-3:], atol=2e-4)
    assert last[:-2] == [None] * (len(prompt) - 2)
    np.testing.assert_allclose(last[-2:], chosen[-2:], atol=2e-4)
    for seq in res.sequences:
        assert len(seq.topk_logprobs) == len(seq.tokens)
        for lp, row in zip(seq.logprobs, seq.topk_logprobs, strict=True):
            assert len(row) == 2 and row[0][1] >= row[1][1] and lp <= row[0][1] + 1e-6


def test_stable_reinforce_and_gspo_as_the_cookbook_sends_them(service, treadle_server):
    """tinker-cookbook 0.6.1's default loss: samples recorded with record_stability_info,
    datums carrying provenance spans (Datum.with_provenance), a 400 naming the field for
    another session's sequences; gspo with its sequence_ratio_mask."""
    tc = service.create_lora_training_client(base_model=treadle_server.model_name, rank=4).result()
    sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    prompt = [5, 17, 33, 2, 40, 41]
    params = T.SamplingParams(max_tokens=5, temperature=1.0, seed=1, stop=[])
    seqs = sampler.sample(T.ModelInput.from_ints(prompt), 2, params).result().sequences
    data_sr, data_gspo = [], []
    for seq, adv in zip(seqs, (1.0, -1.0), strict=True):
        n, k = len(prompt) - 1, len(seq.tokens)
        inputs = {
            "target_tokens": prompt[1:] + seq.tokens,
            "logprobs": [0.0] * n + seq.logprobs,
            "advantages": [0.0] * n + [adv] * k,
        }
        datum = T.Datum(
            model_input=T.ModelInput.from_ints(prompt + seq.tokens[:-1]), loss_fn_inputs=inputs
        )
        data_sr.append(
            datum.with_provenance(
                model_input=[
                    T.PromptProvenanceSpan(sequence_id=seq.sequence_id, length=len(prompt)),
                    T.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=k - 1),
                ],
                loss_fn_inputs=[
                    T.PromptProvenanceSpan(sequence_id=seq.sequence_id, offset=1, length=n),
                    T.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=k),
                ],
            )
        )
        mask = {"sequence_ratio_mask": [0.0] * n + [1.0] * k}
        data_gspo.append(T.Datum(model_input=datum.model_input, loss_fn_inputs={**inputs, **mask}))
    out = tc.forward_backward(data_sr, "stable_reinforce").result()
    # on-policy: importance weight 1 and no KL, so the loss is -sum(A * lp) on sampled tokens
    want = sum(
        -(np.asarray(d.loss_fn_inputs["advantages"].data) * o["logprobs"].to_numpy()).sum()
        for d, o in zip(data_sr, out.loss_fn_outputs, strict=True)
    )
    assert out.metrics["loss:sum"] == pytest.approx(want, rel=1e-3, abs=1e-3)
    out = tc.forward_backward(data_gspo, "gspo").result()
    assert math.isfinite(out.metrics["loss:sum"])
    # a weights mask next to logprobs and advantages, as the managed service's example sends
    weighted = [
        T.Datum(
            model_input=d.model_input,
            loss_fn_inputs={
                **{k: v for k, v in d.loss_fn_inputs.items() if k != "sequence_ratio_mask"},
                "weights": [0.0] * (len(prompt) - 1) + [0.5] * len(seq.tokens),
            },
        )
        for d, seq in zip(data_gspo, seqs, strict=True)
    ]
    out = tc.forward(weighted, "importance_sampling").result()
    want = 0.0
    for d, o in zip(weighted, out.loss_fn_outputs, strict=True):
        lp, s = o["logprobs"].to_numpy(), np.asarray(d.loss_fn_inputs["logprobs"].data)
        adv, w = (np.asarray(d.loss_fn_inputs[k].data) for k in ("advantages", "weights"))
        want += float(-(np.exp(lp - s) * adv * w).sum())
    assert out.metrics["loss:sum"] == pytest.approx(want, rel=1e-4, abs=1e-4)
    tc.optim_step(T.AdamParams(learning_rate=1e-3)).result()

    other = tinker.ServiceClient(base_url=treadle_server.url, api_key=API_KEY)
    tc_other = other.create_lora_training_client(base_model=treadle_server.model_name, rank=4)
    tc_other = tc_other.result()
    with pytest.raises(tinker.BadRequestError, match="sampled by another session") as err:
        tc_other.forward_backward(data_sr, "stable_reinforce").result()
    assert "data[0].loss_fn_input_spans[0].sequence_id" in str(err.value)
    other.close("success").result(timeout=30)
