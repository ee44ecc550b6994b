"""Load a Hugging Face causal LM folder as the engine's frozen base model.

The base never trains: every parameter has requires_grad False, and LoRA adapters
(treadle.engine.lora) add their updates on top of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from treadle.errors import InvalidRequestError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class BaseModel:
    """A loaded base: the module, its tokenizer and the facts the engine needs about them."""

    model: nn.Module
    tokenizer: object  # a transformers PreTrainedTokenizerBase
    model_dir: Path
    vocab_size: int  # width of the logits; valid token ids are [0, vocab_size)
    max_seq_len: int  # config.max_position_embeddings
    eos_token_ids: list[int]  # config's eos ids (int or list) plus the tokenizer's eos
    tied_embeddings: bool  # lm_head.weight is the input embedding matrix
    dtype: torch.dtype
    device: torch.device


def resolve_dtype(dtype: str) -> torch.dtype:
    if dtype not in DTYPES:
        raise InvalidRequestError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def load_base_model(
    model_dir: str | Path, dtype: str = "float32", device: str = "cpu"
) -> BaseModel:
    """Load model and tokenizer from a local folder (never the hub) and freeze the model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise InvalidRequestError(f"model_dir must be a model folder with config.json, got {path}")
    torch_dtype = resolve_dtype(dtype)
    dev = torch.device(device)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, local_files_only=True)
    model.to(dev)
    model.eval()  # no dropout: training and sampling must see the same function
    model.requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)

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
        model_dir=path,
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
