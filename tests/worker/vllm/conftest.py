"""Fixtures of the vLLM sampler's contract tests: a real engine on the tiny model, and a real
vLLM process (the vLLM virtualenv's, `make vllm-venv`) driven by a VllmSampler.

Without the virtualenv these tests skip, saying how to build it; CI builds it (.ci/run).
"""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from treadle.engine import Engine

    return Engine(tiny_model_dir)


@pytest.fixture(scope="session")
def vllm_python() -> str:
    from treadle.worker.vllm.process import find_python

    try:
        return find_python()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def vllm_sampler(engine, vllm_python, tiny_model_dir):
    """A VllmSampler on the module's engine, its process up (startup: tens of seconds)."""
    from treadle.worker.vllm.gate import ParityGate, thresholds_for
    from treadle.worker.vllm.process import VllmSettings
    from treadle.worker.vllm.sampler import VllmSampler

    settings = VllmSettings(
        python=vllm_python,
        model=str(tiny_model_dir),
        max_loras=3,
        max_lora_rank=16,
        max_model_len=1024,
        kv_cache_gb=0.25,
    )
    sampler = VllmSampler(engine, settings, ParityGate(thresholds_for("float32")))
    sampler.start(wait=True)
    yield sampler
    sampler.stop()
