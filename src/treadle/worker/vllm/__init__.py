"""vLLM as the worker's sampler (`treadle serve --sampler vllm`), behind the parity gate.

vLLM runs in a process of its own, under its own virtualenv (driver.py; process.py starts
and watches it); sampler.py decides which requests it takes and keeps one vLLM LoRA per
immutable snapshot; batch.py puts it behind the executor's decode-batch face; gate.py
checks its logprobs against Treadle's engine. See docs/sampling-backends.md.
"""

from __future__ import annotations

from typing import Any

from treadle.protocol.worker_config import WorkerConfig
from treadle.worker.vllm.gate import ParityGate, thresholds_for
from treadle.worker.vllm.process import VllmSettings, find_python
from treadle.worker.vllm.sampler import VllmSampler


def vllm_sampler(config: WorkerConfig, engine: Any, wait: bool = False) -> VllmSampler:
    """The worker's VllmSampler, its process started (in the background unless `wait`)."""
    dtype = str(engine.dtype).replace("torch.", "")
    settings = VllmSettings(
        python=find_python(config.vllm_python),
        model=str(engine.model_dir),
        dtype=dtype,
        max_loras=config.vllm_max_loras,
        max_lora_rank=config.vllm_max_lora_rank,
        max_model_len=int(engine.max_seq_len),
        kv_cache_gb=config.vllm_kv_cache_gb,
    )
    gate = ParityGate(thresholds_for(dtype, config.parity_max_abs), enabled=config.parity_gate)
    sampler = VllmSampler(engine, settings, gate)
    sampler.start(wait=wait)
    return sampler
