"""Mixture-of-experts bases served like dense ones: sampling with per-row adapters (past
gpt-oss's sliding window), sampler/trainer agreement, continuous batching, exports checked by
their consumers (peft with target_parameters, plain transformers) and save_state / resume,
on both tiny architectures (moe_dir); and gpt-oss's released MXFP4 format.

    .venv/bin/python -m pytest -q tests/engine/test_moe_serving.py
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from treadle.engine.decode import joinable
from treadle.engine.tiny import SLIDING_WINDOW, make_tiny_model
from treadle.engine.types import (
    AdamSpec,
    LoraSpec,
    SampleRequest,
    SampleSpec,
    TrainBatch,
    TrainDatum,
)

ATOL = 1e-4
MAX_TOKENS = SLIDING_WINDOW + 8  # prompts plus completions run past the sliding window


@pytest.fixture(scope="module")
def adapters(moe_engine):
    """Two trained-looking adapters (random B): one on everything, one on the experts alone."""
    specs = {
        "moe-all": LoraSpec(rank=4, alpha=8, seed=1),
        "moe-experts": LoraSpec(rank=2, alpha=4, seed=2, train_attn=False, train_unembed=False),
    }
    gen = torch.Generator().manual_seed(0)
    for aid, spec in specs.items():
        moe_engine.create_adapter(aid, spec)
        with torch.no_grad():
            for pair in moe_engine.bank.live(aid).layers.values():
                pair.B.copy_(torch.randn(pair.B.shape, generator=gen) * 0.1)
    yield list(specs)
    for aid in specs:
        moe_engine.drop_adapter(aid)


def _prompts(engine) -> list[list[int]]:
    """Three prompts shorter than the sliding window, and one longer: its prefill already
    drops slots from the sliding layers' cache."""
    texts = ["Question: Ana has 3 apples. He buys 2 more. How many", "Hi", "Max has 12 coins."]
    long = torch.randint(
        0, engine.vocab_size, (2 * SLIDING_WINDOW + 3,), generator=torch.Generator().manual_seed(9)
    )
    return [engine.tokenizer.encode(t) for t in texts] + [long.tolist()]


def _req(prompt, adapter, n=1, **params) -> SampleRequest:
    spec = SampleSpec(**{"max_tokens": MAX_TOKENS, "stop_at_eos": False, **params})
    return SampleRequest(prompt=prompt, num_samples=n, params=spec, adapter=adapter)


def _trainer_logprobs(engine, adapter: str, prompt: list[int], tokens: list[int]) -> np.ndarray:
    full = np.array(prompt + tokens, dtype=np.int64)
    inputs = {"target_tokens": full[1:], "weights": np.ones(len(full) - 1, np.float32)}
    batch = TrainBatch(adapter, [TrainDatum(full[:-1], inputs)])
    (res,) = engine.forward_backward([batch], forward_only=True)
    return res.outputs[0]["logprobs"][len(prompt) - 1 :]


@torch.no_grad()
def _logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).logits.float().log_softmax(-1)  # (B, T, V)


@torch.no_grad()
def _engine_logprobs(engine, key: str, ids: torch.Tensor) -> torch.Tensor:
    with engine.bank.rows([key] * ids.shape[0]):
        return _logprobs(engine.model, ids)


def _ids(engine, B: int = 3, T: int = SLIDING_WINDOW + 6) -> torch.Tensor:
    return torch.randint(0, engine.vocab_size, (B, T), generator=torch.Generator().manual_seed(1))


# ---- sampling ----
def test_sampler_logprobs_equal_trainer_logprobs(moe_engine, adapters):
    """Rows of two adapters and the base in one decode batch, each past the sliding window:
    the trainer's forward scores the sampled tokens as the sampler did."""
    p = _prompts(moe_engine)
    reqs = [
        _req(p[0], adapters[0], n=2, seed=1),
        _req(p[1], None, seed=2, temperature=0.7),
        _req(p[2], adapters[1], n=2, seed=3, top_p=0.9),
        _req(p[3], adapters[0], seed=4),
    ]
    results = moe_engine.sample(reqs)
    for r, res in zip(reqs, results, strict=True):
        for seq in res.sequences:
            assert len(seq.tokens) == MAX_TOKENS
            want = _trainer_logprobs(moe_engine, r.adapter or adapters[0], r.prompt, seq.tokens)
            if r.adapter is None:  # base rows: score with a fresh adapter, which is the base
                moe_engine.create_adapter("fresh", LoraSpec(rank=2))
                want = _trainer_logprobs(moe_engine, "fresh", r.prompt, seq.tokens)
                moe_engine.drop_adapter("fresh")
            np.testing.assert_allclose(seq.logprobs, want, atol=ATOL, rtol=0)
    # the adapters matter: one prompt and seed, other tokens under each
    again = moe_engine.sample([_req(p[0], k, seed=5) for k in (*adapters, None)])
    assert len({tuple(r.sequences[0].tokens) for r in again}) == 3


def test_mixed_sampling_equals_each_request_alone(moe_engine, adapters):
    p = _prompts(moe_engine)
    reqs = [
        _req(p[0], adapters[0], n=2, seed=1),
        _req(p[1], adapters[1], seed=2, temperature=0),
        _req(p[2], None, seed=3, top_k=20),
        _req(p[1], adapters[0], seed=4, max_tokens=5),
        _req(p[3], adapters[1], seed=5),
    ]
    together = moe_engine.sample(reqs)
    for r, res in zip(reqs, together, strict=True):
        (alone,) = moe_engine.sample([r])
        assert [s.tokens for s in res.sequences] == [s.tokens for s in alone.sequences]
        for a, b in zip(alone.sequences, res.sequences, strict=True):
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=ATOL, rtol=0)


@pytest.mark.parametrize("late", [2, 3])  # a short prompt joins; a long one, past the window
def test_requests_join_the_running_decode_batch(moe_engine, adapters, late):
    """Requests added while others decode join the running rows (continuous batching), on
    gpt-oss too: its sliding-window layers keep their whole cache while sampling, and the
    mask does the windowing. Every request gets what it gets alone."""
    p = _prompts(moe_engine)
    first, second = _req(p[3], adapters[0], n=2, seed=1), _req(p[late], adapters[1], seed=2)
    batch = moe_engine.decode_batch()
    h1 = batch.add([first])[0]
    done = dict(batch.step(max_steps=SLIDING_WINDOW // 2))
    h2 = batch.add([second])[0]
    assert joinable(batch.cohort) and not batch.waiting and batch.rows == 3
    while len(batch):
        done |= dict(batch.step())
    for h, r in ((h1, first), (h2, second)):
        (alone,) = moe_engine.sample([r])
        assert [s.tokens for s in done[h].sequences] == [s.tokens for s in alone.sequences]
        for a, b in zip(alone.sequences, done[h].sequences, strict=True):
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=ATOL, rtol=0)


# ---- exports ----
def test_peft_export_loads_in_peft_and_scores_like_the_service(
    moe_dir, moe_engine, adapters, tmp_path
):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    for aid in adapters:
        out = tmp_path / aid
        moe_engine.save_adapter(aid, out)
        config = json.loads((out / "adapter_config.json").read_text())
        assert sorted(config["target_parameters"]) == [
            "mlp.experts.down_proj",
            "mlp.experts.gate_up_proj",
        ]
        assert (config["target_modules"] == []) == (aid == "moe-experts")
        peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(moe_dir), out)
        ids = _ids(moe_engine)
        ours = _engine_logprobs(moe_engine, aid, ids)
        assert (ours - _engine_logprobs(moe_engine, None, ids)).abs().max() > 1e-2
        torch.testing.assert_close(_logprobs(peft_model.eval(), ids), ours, rtol=1e-5, atol=1e-5)
        # and back: the export imports as the very same weights
        moe_engine.load_adapter(f"{aid}-again", out)
        again = moe_engine.bank.live(f"{aid}-again").layers
        for path, pair in moe_engine.bank.live(aid).layers.items():
            assert torch.equal(again[path].A, pair.A) and torch.equal(again[path].B, pair.B)
            assert again[path].scale == pair.scale
        moe_engine.drop_adapter(f"{aid}-again")


def test_merged_export_loads_in_plain_transformers(moe_dir, moe_engine, adapters, tmp_path):
    from transformers import AutoModelForCausalLM

    moe_engine.save_merged(adapters[0], tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    ids = _ids(moe_engine)
    torch.testing.assert_close(
        _logprobs(merged, ids), _engine_logprobs(moe_engine, adapters[0], ids), rtol=1e-5, atol=2e-5
    )
    # the router is the base's: only the adapted weights changed
    base = dict(moe_engine.model.named_parameters())
    for name, p in merged.named_parameters():
        adapted = name.removesuffix(".weight") in moe_engine.bank.live(adapters[0]).layers
        assert torch.equal(p, base[name]) != adapted, name


def test_state_roundtrip_continues_exactly(moe_engine, moe_datum, new_id, tmp_path):
    aid = new_id()
    moe_engine.create_adapter(aid, LoraSpec(rank=4, alpha=8, seed=6))
    adam = AdamSpec(learning_rate=1e-2, weight_decay=0.05, grad_clip_norm=0.5)
    for step in range(2):
        moe_engine.forward_backward([TrainBatch(aid, [moe_datum(SLIDING_WINDOW + 3, seed=step)])])
        moe_engine.optim_step(aid, adam)
    moe_engine.save_state(aid, tmp_path / "state")
    resumed = new_id()
    moe_engine.load_state(resumed, tmp_path / "state")
    assert moe_engine.adapter_step(resumed) == 2
    for step in range(2):
        batch = [moe_datum(9, seed=100 + step)]
        for x in (aid, resumed):
            moe_engine.forward_backward([TrainBatch(x, batch)])
            moe_engine.optim_step(x, adam)
    pairs = zip(
        moe_engine.bank.live(aid).parameters(),
        moe_engine.bank.live(resumed).parameters(),
        strict=True,
    )
    assert all(torch.equal(p, q) for p, q in pairs)
    moe_engine.drop_adapter(aid)
    moe_engine.drop_adapter(resumed)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ("rows", "do not split into"),  # lora_A rows not a multiple of the experts
        ("width", "expected"),  # lora_B of another output width
        ("nesting", "not a LoRA weight of this model"),  # a third nested parameter
    ],
)
def test_bad_expert_weights_are_refused_naming_them(moe_engine, adapters, tmp_path, change, match):
    from treadle.errors import InvalidRequestError

    moe_engine.save_adapter(adapters[1], tmp_path)
    file = tmp_path / "adapter_model.safetensors"
    weights = load_file(file)
    key = "base_model.model.model.layers.0.mlp.experts.lora_"
    if change == "rows":
        weights[f"{key}A.weight"] = weights[f"{key}A.weight"][:-1]
    elif change == "width":
        weights[f"{key}B.weight"] = weights[f"{key}B.weight"][:-1]
    else:
        inner = "base_model.model.model.layers.0.mlp.experts.base_layer.base_layer.lora_A.weight"
        weights[inner] = weights[f"{key}A.weight"].clone()
    save_file(weights, file)
    with pytest.raises(InvalidRequestError, match=match) as err:
        moe_engine.load_adapter("bad-experts", tmp_path)
    assert "layers.0.mlp.experts" in str(err.value)
    assert "bad-experts" not in moe_engine.bank


# ---- gpt-oss as released: MXFP4 experts ----
def _mxfp4_folder(src, dst) -> None:
    """src's gpt-oss folder with its experts stored as gpt-oss is released: MXFP4 blocks of 32
    4-bit values with one 8-bit exponent each, (E, out, in/32, 16) and (E, out, in/32)."""
    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    for key in [k for k in weights if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        E, n_in, n_out = weights.pop(key).shape
        blocks = torch.randint(0, 256, (E, n_out, n_in // 32, 16), generator=gen, dtype=torch.uint8)
        scales = torch.randint(121, 126, (E, n_out, n_in // 32), generator=gen, dtype=torch.uint8)
        weights[f"{key}_blocks"], weights[f"{key}_scales"] = blocks, scales
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (dst / "config.json").write_text(json.dumps(config))


def test_gpt_oss_mxfp4_folder_serves_with_lora_on_its_experts(tmp_path):
    from transformers import AutoModelForCausalLM, Mxfp4Config
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from treadle.engine import Engine

    _mxfp4_folder(make_tiny_model(tmp_path / "dense", arch="gpt_oss"), tmp_path / "mxfp4")
    engine = Engine(tmp_path / "mxfp4")
    experts = engine.model.model.layers[0].mlp.experts
    packed = load_file(tmp_path / "mxfp4" / "model.safetensors")
    key = "model.layers.0.mlp.experts.gate_up_proj"
    want = convert_moe_packed_tensors(
        packed[f"{key}_blocks"], packed[f"{key}_scales"], dtype=torch.float32
    )
    assert torch.equal(experts.gate_up_proj, want)  # dequantised exactly, dense fp32
    assert len(engine.bank.experts) == 2 * engine.model.config.num_hidden_layers
    plain = AutoModelForCausalLM.from_pretrained(
        tmp_path / "mxfp4", dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True)
    ).eval()
    engine.create_adapter("a", LoraSpec(rank=2))
    ids = _ids(engine)
    torch.testing.assert_close(
        _engine_logprobs(engine, "a", ids), _logprobs(plain, ids), rtol=0, atol=2e-4
    )
    engine.forward_backward(
        [
            TrainBatch(
                "a",
                [
                    TrainDatum(
                        ids[0, :-1].numpy(),
                        {
                            "target_tokens": ids[0, 1:].numpy(),
                            "weights": np.ones(ids.shape[1] - 1, np.float32),
                        },
                    )
                ],
            )
        ]
    )
    engine.optim_step("a", AdamSpec(learning_rate=1e-2))
    engine.save_merged("a", tmp_path / "merged")  # a dense folder plain transformers loads
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    torch.testing.assert_close(
        _logprobs(merged, ids), _engine_logprobs(engine, "a", ids), rtol=1e-5, atol=2e-5
    )
