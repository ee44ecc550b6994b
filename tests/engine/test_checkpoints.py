"""Exports checked by their consumers: peft loads our adapters, plain transformers loads our
merged models, and a saved training state continues exactly like uninterrupted training."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from treadle.engine.types import AdamSpec, LoraSpec, TrainBatch
from treadle.errors import ConflictError, InvalidRequestError


def _ids(engine, B: int = 3, T: int = 10) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, engine.vocab_size, (B, T), generator=gen)  # (B, T)


@torch.no_grad()
def _engine_logprobs(engine, key: str, ids: torch.Tensor) -> torch.Tensor:
    with engine.bank.rows([key] * ids.shape[0]):
        return engine.model(input_ids=ids).logits.float().log_softmax(-1)  # (B, T, V)


@torch.no_grad()
def _logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).logits.float().log_softmax(-1)  # (B, T, V)


def _trained(engine, new_id, sft_datum, spec: LoraSpec, steps: int = 2) -> str:
    aid = new_id()
    engine.create_adapter(aid, spec)
    for step in range(steps):
        engine.forward_backward(
            [TrainBatch(aid, [sft_datum(8, seed=step), sft_datum(5, seed=50 + step)])]
        )
        engine.optim_step(aid, AdamSpec(learning_rate=2e-2, weight_decay=0.01))
    return aid


def _base(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir)


@pytest.mark.parametrize(
    "spec",
    [
        LoraSpec(rank=4, alpha=8, seed=1),  # every target, lm_head on tied embeddings included
        LoraSpec(rank=2, alpha=2, seed=2, train_mlp=False, train_unembed=False),
    ],
)
def test_peft_loads_exported_adapter(engine, model_dir, sft_datum, new_id, tmp_path, spec):
    from peft import PeftModel

    aid = _trained(engine, new_id, sft_datum, spec)
    engine.save_adapter(aid, tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == spec.rank
    assert config["lora_alpha"] == spec.alpha and config["task_type"] == "CAUSAL_LM"
    peft_model = PeftModel.from_pretrained(_base(model_dir), tmp_path / "adapter")
    ids = _ids(engine)
    ours = _engine_logprobs(engine, aid, ids)
    assert (ours - _logprobs(_base(model_dir), ids)).abs().max() > 1e-3  # trained: not the base
    torch.testing.assert_close(_logprobs(peft_model, ids), ours, rtol=1e-5, atol=1e-5)
    engine.drop_adapter(aid)


def test_snapshot_exports_its_frozen_weights(engine, model_dir, sft_datum, new_id, tmp_path):
    from peft import PeftModel

    aid = _trained(engine, new_id, sft_datum, LoraSpec(rank=4, seed=3), steps=1)
    snap = new_id("snap")
    engine.snapshot(aid, snap)
    ids = _ids(engine)
    frozen = _engine_logprobs(engine, snap, ids)
    engine.forward_backward([TrainBatch(aid, [sft_datum(8, seed=9)])])
    engine.optim_step(aid, AdamSpec(learning_rate=5e-2))
    engine.save_adapter(snap, tmp_path / "snap")
    peft_model = PeftModel.from_pretrained(_base(model_dir), tmp_path / "snap")
    torch.testing.assert_close(_logprobs(peft_model, ids), frozen, rtol=1e-5, atol=1e-5)
    engine.drop_snapshot(snap)
    engine.drop_adapter(aid)


def test_load_adapter_roundtrip(engine, sft_datum, new_id, tmp_path):
    aid = _trained(engine, new_id, sft_datum, LoraSpec(rank=4, alpha=16, seed=4, train_attn=False))
    engine.save_adapter(aid, tmp_path / "a")
    copy = new_id()
    engine.load_adapter(copy, tmp_path / "a")
    src, dst = engine.bank.live(aid), engine.bank.live(copy)
    assert dst.spec == src.spec
    assert list(dst.layers) == list(src.layers)
    for p, q in zip(src.parameters(), dst.parameters(), strict=True):
        assert torch.equal(p, q)
    with pytest.raises(ConflictError):
        engine.load_adapter(copy, tmp_path / "a")
    engine.drop_adapter(aid)
    engine.drop_adapter(copy)


@pytest.mark.parametrize("rslora", [False, True])
def test_import_external_peft_adapter(engine, model_dir, new_id, tmp_path, rslora):
    """An adapter trained elsewhere (per-module ranks and alphas, rslora) gives peft's numbers."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj", "down_proj"],
        rank_pattern={"down_proj": 2},
        alpha_pattern={"v_proj": 3},
        use_rslora=rslora,
        init_lora_weights=False,  # random B: not the base
        lora_dropout=0.0,
    )
    torch.manual_seed(0)
    peft_model = get_peft_model(_base(model_dir), config)
    peft_model.eval()
    peft_model.save_pretrained(tmp_path / "ext")
    aid = new_id()
    engine.load_adapter(aid, tmp_path / "ext")
    ids = _ids(engine)
    torch.testing.assert_close(
        _engine_logprobs(engine, aid, ids), _logprobs(peft_model, ids), rtol=1e-5, atol=1e-5
    )
    spec = engine.bank.live(aid).spec
    assert (spec.rank, spec.train_attn, spec.train_mlp, spec.train_unembed) == (
        4,
        True,
        True,
        False,
    )
    # and it trains like any adapter
    engine.forward_backward([TrainBatch(aid, [_datum_for(engine)])])
    engine.optim_step(aid, AdamSpec(learning_rate=1e-3))
    engine.drop_adapter(aid)


def test_a_peft_adapter_on_a_tied_lm_head_imports_as_peft_wrote_it(
    engine, model_dir, new_id, tmp_path
):
    """peft saves lm_head.base_layer.weight beside a LoRA on an lm_head tied to the input
    embedding: a copy of the base weight is taken, a changed one refused naming the key."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file, save_file

    config = LoraConfig(
        r=4, target_modules=["q_proj", "lm_head"], init_lora_weights=False, lora_dropout=0.0
    )
    torch.manual_seed(1)
    base = _base(model_dir)
    assert base.config.tie_word_embeddings
    peft_model = get_peft_model(base, config).eval()
    peft_model.save_pretrained(tmp_path / "tied")
    weights = tmp_path / "tied" / "adapter_model.safetensors"
    key = "base_model.model.lm_head.base_layer.weight"
    assert key in load_file(str(weights))  # what peft writes
    aid = new_id()
    engine.load_adapter(aid, tmp_path / "tied")
    ids = _ids(engine)
    torch.testing.assert_close(
        _engine_logprobs(engine, aid, ids), _logprobs(peft_model, ids), rtol=1e-5, atol=1e-5
    )
    assert engine.bank.live(aid).spec.train_unembed
    engine.drop_adapter(aid)

    tensors = load_file(str(weights))
    tensors[key] = tensors[key] + 0.01  # a changed base weight: not an adapter's to carry
    save_file(tensors, str(weights), metadata={"format": "pt"})
    with pytest.raises(InvalidRequestError, match=key.replace(".", r"\.")):
        engine.load_adapter(new_id(), tmp_path / "tied")


def _datum_for(engine):
    from treadle.engine.types import TrainDatum

    tokens = np.arange(6) % engine.vocab_size
    return TrainDatum(tokens, {"target_tokens": tokens, "weights": np.ones(6, np.float32)})


@pytest.mark.parametrize("unembed", [True, False])
def test_merged_model_loads_in_plain_transformers(
    engine, model_dir, sft_datum, new_id, tmp_path, unembed
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    aid = _trained(engine, new_id, sft_datum, LoraSpec(rank=4, seed=5, train_unembed=unembed))
    engine.save_merged(aid, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    ids = _ids(engine)
    torch.testing.assert_close(
        _logprobs(merged, ids), _engine_logprobs(engine, aid, ids), rtol=1e-5, atol=2e-5
    )
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    base_config = json.loads((model_dir / "config.json").read_text())
    assert config["tie_word_embeddings"] == (base_config["tie_word_embeddings"] and not unembed)
    # the input embedding stays the base's even when lm_head was merged
    assert torch.equal(
        merged.get_input_embeddings().weight, engine.model.get_input_embeddings().weight
    )
    assert engine.model.config.tie_word_embeddings == base_config["tie_word_embeddings"]
    tok = AutoTokenizer.from_pretrained(tmp_path / "merged")
    assert tok("Hello")["input_ids"] == engine.tokenizer("Hello")["input_ids"]
    engine.drop_adapter(aid)


def test_state_roundtrip_continues_exactly(engine, sft_datum, new_id, tmp_path):
    spec = LoraSpec(rank=4, alpha=8, seed=6)
    adam = AdamSpec(learning_rate=1e-2, weight_decay=0.05, grad_clip_norm=0.5)
    aid = _trained(engine, new_id, sft_datum, spec, steps=2)
    engine.save_state(aid, tmp_path / "state")
    resumed = new_id()
    engine.load_state(resumed, tmp_path / "state")
    weights_only = new_id()
    engine.load_state(weights_only, tmp_path / "state", with_optimizer=False)
    assert engine.adapter_step(resumed) == 2 and engine.adapter_step(weights_only) == 0
    for step in range(3):
        batch = [sft_datum(7, seed=100 + step)]
        for x in (aid, resumed, weights_only):
            engine.forward_backward([TrainBatch(x, batch)])
            engine.optim_step(x, adam)
    for p, q, _ in zip(
        *(engine.bank.live(x).parameters() for x in (aid, resumed, weights_only)), strict=True
    ):
        assert torch.equal(p, q)
    # a fresh optimizer takes different steps: the state really carried the moments
    assert any(
        not torch.equal(p, r)
        for p, r in zip(
            engine.bank.live(aid).parameters(),
            engine.bank.live(weights_only).parameters(),
            strict=True,
        )
    )
    # load_state replaces an existing adapter
    engine.load_state(aid, tmp_path / "state")
    assert engine.adapter_step(aid) == 2
    for x in (aid, resumed, weights_only):
        engine.drop_adapter(x)


def test_bad_adapter_folders(engine, model_dir, new_id, tmp_path):
    with pytest.raises(InvalidRequestError, match="adapter_config.json"):
        engine.load_adapter(new_id(), tmp_path)
    aid = new_id()
    engine.create_adapter(aid, LoraSpec(rank=2))
    engine.save_adapter(aid, tmp_path / "a")
    config_file = tmp_path / "a" / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config["use_dora"] = True
    config_file.write_text(json.dumps(config))
    with pytest.raises(InvalidRequestError, match="use_dora must be False"):
        engine.load_adapter(new_id(), tmp_path / "a")
    engine.drop_adapter(aid)
