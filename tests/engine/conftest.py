"""Shared fixtures of the engine tests: one tiny model folder per session, an engine on it,
and a plain transformers copy of the same model as the independent reference."""

from __future__ import annotations

import itertools
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from treadle.engine.types import TrainDatum

_ids = itertools.count()

# Tiny matrices gain nothing from threads, and on a busy machine idle-spinning OpenMP workers
# make each op tens of times slower.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def model_dir(tiny_model_dir: Path) -> Path:
    return tiny_model_dir


@pytest.fixture(scope="session")
def engine(model_dir: Path):
    """One engine for the session: tests create adapters under fresh ids (new_id)."""
    from treadle.engine import Engine

    return Engine(model_dir)


@pytest.fixture(scope="session")
def plain_model(model_dir: Path):
    """The same base loaded by plain transformers: the reference the engine is held to."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.eval()
    model.requires_grad_(False)
    return model


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*")
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
        yield


@pytest.fixture
def new_id():
    """Unique adapter / snapshot ids, so tests sharing the session engine never collide."""
    return lambda prefix="ad": f"{prefix}-{next(_ids)}"


@pytest.fixture
def sft_datum(engine):
    """A random next-token datum of length T with weights in [0, 1)."""

    def make(T: int, seed: int, top_k: int = 0) -> TrainDatum:
        rng = np.random.default_rng(seed)
        seq = rng.integers(0, engine.vocab_size, T + 1)
        if top_k:
            targets = rng.integers(0, engine.vocab_size, (T, top_k))
            weights = rng.random((T, top_k)).astype(np.float32)
        else:
            targets = seq[1:]
            weights = rng.random(T).astype(np.float32)
        return TrainDatum(seq[:-1], {"target_tokens": targets, "weights": weights})

    return make


def perturb(adapter, seed: int, std: float = 0.05) -> None:
    """Give B random values so the adapter differs from the base (and A gets gradients)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pair in adapter.layers.values():
            pair.B.copy_(torch.randn(pair.B.shape, generator=gen) * std)


def plain_logprobs(model, tokens: np.ndarray, targets: np.ndarray) -> torch.Tensor:
    """log p(target | prefix) by plain transformers, fp32: (T,) or (T, K)."""
    ids = torch.as_tensor(np.asarray(tokens), dtype=torch.long)[None]  # (1, T)
    logp = model(input_ids=ids).logits[0].float().log_softmax(-1)  # (T, V)
    tgt = torch.as_tensor(np.asarray(targets), dtype=torch.long)
    if tgt.ndim == 1:
        return logp.gather(-1, tgt[:, None])[:, 0]  # (T,)
    return logp.gather(-1, tgt)  # (T, K)


@pytest.fixture
def helpers():
    """perturb and plain_logprobs, as a fixture (tests folders are not packages)."""

    class H:
        pass

    h = H()
    h.perturb = perturb
    h.plain_logprobs = plain_logprobs
    return h


# ---- mixture-of-experts bases: every MoE test runs on both tiny architectures ----
MOE_ARCHS = ("gpt_oss", "qwen3_moe")


def sharpen_moe(model, seed: int = 0) -> None:
    """Confident, varied random weights (HF's init makes a near-uniform model and router):
    every matrix, each expert's included, drawn with variance 1 / fan-in, so the router
    picks its experts by clear margins and greedy decoding says something."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for path, module in model.named_modules():
            for p in module.parameters(recurse=False):
                if p.ndim == 2 and "embed" not in path:
                    p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
                elif p.ndim == 3:  # (E, in, out) when the experts are transposed, else (E, out, in)
                    fan_in = p.shape[1] if getattr(module, "is_transposed", False) else p.shape[2]
                    p.copy_(torch.randn(p.shape, generator=gen) / fan_in**0.5)
        emb = model.get_input_embeddings().weight
        emb.copy_(torch.randn(emb.shape, generator=gen) * 0.1)


@pytest.fixture(scope="session", params=MOE_ARCHS)
def moe_dir(request, tmp_path_factory) -> Path:
    """A tiny MoE folder (make-tiny-model, then sharpened weights saved in place)."""
    from transformers import AutoModelForCausalLM

    from treadle.engine.tiny import make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("moe") / request.param, arch=request.param)
    model = AutoModelForCausalLM.from_pretrained(path)
    sharpen_moe(model)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def moe_engine(moe_dir: Path):
    from treadle.engine import Engine

    return Engine(moe_dir)


@pytest.fixture(scope="session")
def moe_plain(moe_dir: Path):
    """The MoE base in plain transformers, its own experts implementation: the reference."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(moe_dir).eval().requires_grad_(False)


@pytest.fixture
def moe_datum(moe_engine):
    """A random next-token datum of length T of the MoE model's vocabulary, weights in [0, 1)."""

    def make(T: int, seed: int) -> TrainDatum:
        rng = np.random.default_rng(seed)
        seq = rng.integers(0, moe_engine.vocab_size, T + 1)
        w = rng.random(T).astype(np.float32)
        return TrainDatum(seq[:-1], {"target_tokens": seq[1:], "weights": w})

    return make
