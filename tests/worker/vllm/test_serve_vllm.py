"""`treadle serve --sampler vllm` end to end, through the treadle SDK: a trained session's
sampler samples on vLLM (the worker's vLLM process, started in the background: requests
sample on Treadle until it is up), its logprobs are those compute_logprobs gives (Treadle's
engine, the trainer's numbers), the parity gate checked it and did not trip, and /metrics
counts it all.

    .venv/bin/python -m pytest -q tests/worker/vllm/test_serve_vllm.py   (skips without .venv-vllm)
"""

from __future__ import annotations

import re
import time

import httpx

from treadle import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient

TINY = "treadle/tiny-llama"
WAIT = 120
PROMPT = [5, 17, 33, 2, 40, 41, 60, 7]


def _events(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    pattern = r'^treadle_sampler_events_total\{[^}]*event="(\w+)"[^}]*\} ([0-9.e+]+)$'
    return {m[1]: float(m[2]) for m in re.finditer(pattern, text, re.M)}


def test_serve_samples_on_vllm_with_the_trainers_logprobs(start_server, vllm_python):
    config = {
        "sampler": "vllm",
        "vllm_python": vllm_python,
        "vllm_kv_cache_gb": 0.25,
        "vllm_max_lora_rank": 16,
    }
    server = start_server(config=config, process=True)
    with ServiceClient(base_url=server.url) as svc:
        tc = svc.create_lora_training_client(base_model=TINY, rank=8)
        tokens = list(range(3, 40))
        datum = Datum(
            model_input=ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
        )
        for _ in range(2):  # weights of its own, far from the base model's
            tc.forward_backward([datum]).result(WAIT)
            tc.optim_step(AdamParams(learning_rate=0.05)).result(WAIT)
        sc = tc.save_weights_and_get_sampling_client()
        params = SamplingParams(max_tokens=10, temperature=1.0, seed=1)
        deadline = time.monotonic() + 300  # vLLM's startup under a loaded CI machine
        while _events(server.url).get("vllm_samples", 0) == 0:
            assert time.monotonic() < deadline, "vLLM never took a request"
            result = sc.sample(PROMPT, num_samples=2, sampling_params=params).result(WAIT)
            time.sleep(1.0)  # a heartbeat carries the counters
        result = sc.sample(PROMPT, num_samples=3, sampling_params=params).result(WAIT)
        for seq in result.sequences:
            assert len(seq.tokens) == len(seq.logprobs) > 0
            scored = sc.compute_logprobs(PROMPT + seq.tokens).result(WAIT)[len(PROMPT) :]
            assert max(abs(a - b) for a, b in zip(seq.logprobs, scored, strict=True)) <= 1e-5
        time.sleep(2.0)
        events = _events(server.url)
    assert events["vllm_samples"] >= 2 and events["parity_checks"] >= 1
    assert events.get("parity_trips", 0) == 0 and events.get("fell_back", 0) == 0
