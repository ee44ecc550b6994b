"""Load a Hugging Face causal LM as the engine's frozen base model.

The base never trains: every parameter has requires_grad False, and LoRA adapters
(treadle.engine.lora) add their updates on top of it.

A model path is one of
- a model folder with config.json (weights and tokenizer files beside it);
- a `.gguf` file (llama.cpp's format), which holds config, weights, tokenizer and chat
  template: transformers (with the `gguf` package) dequantises it into a dense model;
- a folder without config.json that holds exactly one `.gguf` file: that file.
Everything loads offline (local_files_only). Dense and mixture-of-experts models alike; the
weights LoRA targets must be dense, so a GGUF is dequantised, and so are MXFP4 experts (the
format gpt-oss is released in: kept packed, they would have no fused weight to adapt).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from treadle.engine.model_files import (
    check_architecture,
    load_tokenizer,
    model_source,
    source_kwargs,
)
from treadle.errors import InvalidRequestError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class BaseModel:
    """A loaded base: the module, its tokenizer and the facts the engine needs about them."""

    model: nn.Module
    tokenizer: object  # a transformers PreTrainedTokenizerBase
    model_dir: Path  # the path it was loaded from: a model folder or a .gguf file
    vocab_size: int  # width of the logits; valid token ids are [0, vocab_size)
    max_seq_len: int  # config.max_position_embeddings (a GGUF's context_length)
    eos_token_ids: list[int]  # config's eos ids (int or list) plus the tokenizer's eos
    tied_embeddings: bool  # lm_head.weight is the input embedding matrix
    dtype: torch.dtype
    device: torch.device


def resolve_dtype(dtype: str) -> torch.dtype:
    if dtype not in DTYPES:
        raise InvalidRequestError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def _dense_weights() -> dict:
    """from_pretrained kwargs that make a GGUF load as dense nn.Linear weights."""
    try:
        from transformers import GgufConfig
    except ImportError:  # older transformers always dequantise
        return {}
    # Newer transformers keeps the weights in packed blocks when it has kernels for them
    # (not nn.Linear, so no LoRA) and cannot save such a model; ask for dense weights.
    return {"quantization_config": GgufConfig(dequantize=True)}


def _dense_experts(folder: Path) -> dict:
    """from_pretrained kwargs that load MXFP4-packed experts as dense weights (transformers
    only dequantises them by itself where it lacks the kernels, as on a CPU)."""
    config = json.loads((folder / "config.json").read_text())
    quant = config.get("quantization_config") or {}
    if quant.get("quant_method") != "mxfp4":
        return {}
    from transformers import Mxfp4Config

    return {"quantization_config": Mxfp4Config(dequantize=True)}


# transformers' from_pretrained patches process-wide functions while it builds a model (its
# empty-weights and no-init contexts); two loads at once on threads of one process (engine
# workers on threads) can leave them patched for good, and every later model is built on
# the meta device. Loads in one process take turns.
_LOADING = threading.Lock()


def load_base_model(
    model_dir: str | Path, dtype: str = "float32", device: str = "cpu"
) -> BaseModel:
    """Load model and tokenizer from a local folder or GGUF file (never the hub), frozen."""
    from transformers import AutoModelForCausalLM

    folder, gguf = model_source(model_dir)
    check_architecture(model_dir)
    torch_dtype = resolve_dtype(dtype)
    dev = torch.device(device)
    kwargs = source_kwargs(gguf) | (_dense_weights() if gguf else _dense_experts(folder))
    with _LOADING:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype, **kwargs)
    model.to(dev)
    model.eval()  # no dropout: training and sampling must see the same function
    model.requires_grad_(False)
    tokenizer = load_tokenizer(model_dir)

    config = model.config
    out_emb = model.get_output_embeddings()
    vocab_size = int(out_emb.weight.shape[0]) if out_emb is not None else int(config.vocab_size)
    in_emb = model.get_input_embeddings()
    tied = out_emb is not None and in_emb is not None and out_emb.weight is in_emb.weight
    max_len = getattr(config, "max_position_embeddings", None) or getattr(
        tokenizer, "model_max_length", 2048
    )
    return BaseModel(
        model=model,
        tokenizer=tokenizer,
        model_dir=Path(model_dir),
        vocab_size=vocab_size,
        max_seq_len=int(max_len),
        eos_token_ids=eos_token_ids(config, tokenizer, getattr(model, "generation_config", None)),
        tied_embeddings=tied,
        dtype=torch_dtype,
        device=dev,
    )


def eos_token_ids(config: object, tokenizer: object, generation_config: object = None) -> list[int]:
    """Every id that ends a sequence: config and generation config (int or list) + tokenizer."""
    ids: list[int] = []
    for source in (config, generation_config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is None:
            continue
        for v in [value] if isinstance(value, int) else list(value):
            if int(v) not in ids:
                ids.append(int(v))
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    if tok_eos is not None and int(tok_eos) not in ids:
        ids.append(int(tok_eos))
    return ids
