"""Loading the base model: frozen, the right facts about vocabulary, length and EOS."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from treadle.engine.model_files import model_source, smollm2_gguf, tokenizer_folder
from treadle.engine.models import eos_token_ids, load_base_model
from treadle.errors import InvalidRequestError


def test_loads_frozen_with_config_facts(model_dir):
    base = load_base_model(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    assert base.vocab_size == config["vocab_size"]
    assert base.max_seq_len == config["max_position_embeddings"]
    eos = config["eos_token_id"]
    for token in [eos] if isinstance(eos, int) else eos:
        assert token in base.eos_token_ids
    assert base.tokenizer.eos_token_id in base.eos_token_ids
    assert not any(p.requires_grad for p in base.model.parameters())
    assert not base.model.training
    assert base.tied_embeddings == config.get("tie_word_embeddings", False)
    assert all(p.dtype == torch.float32 for p in base.model.parameters())


def test_bfloat16(model_dir):
    base = load_base_model(model_dir, dtype="bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in base.model.parameters())


def test_eos_ids_from_int_list_and_tokenizer():
    tok = SimpleNamespace(eos_token_id=7)
    assert eos_token_ids(SimpleNamespace(eos_token_id=3), tok) == [3, 7]
    assert eos_token_ids(SimpleNamespace(eos_token_id=[3, 7, 9]), tok) == [3, 7, 9]
    gen = SimpleNamespace(eos_token_id=[4])
    assert eos_token_ids(SimpleNamespace(eos_token_id=None), tok, gen) == [4, 7]


def test_bad_dtype_and_folder(model_dir, tmp_path):
    with pytest.raises(InvalidRequestError, match="dtype must be one of"):
        load_base_model(model_dir, dtype="float16x")
    with pytest.raises(InvalidRequestError, match="config.json"):
        load_base_model(tmp_path)


def test_model_source_folder_or_gguf(model_dir, tmp_path):
    assert model_source(model_dir) == (model_dir, None)
    (tmp_path / "m.Q4.gguf").write_bytes(b"GGUF")
    assert model_source(tmp_path / "m.Q4.gguf") == (tmp_path, "m.Q4.gguf")
    assert model_source(tmp_path) == (tmp_path, "m.Q4.gguf")  # one .gguf, no config.json
    (tmp_path / "other.gguf").write_bytes(b"GGUF")
    with pytest.raises(InvalidRequestError, match="exactly one .gguf"):
        model_source(tmp_path)
    with pytest.raises(InvalidRequestError, match="not found"):
        model_source(tmp_path / "missing.gguf")


def test_tokenizer_folder_of_a_model_folder_is_the_folder(model_dir, tmp_path):
    assert tokenizer_folder(model_dir, tmp_path / "cache") == model_dir
    assert not (tmp_path / "cache").exists()


def test_smollm2_gguf_is_a_file_or_none():
    path = smollm2_gguf()
    assert path is None or (path.is_file() and path.suffix == ".gguf")
