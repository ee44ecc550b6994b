"""Sampling backends: Treadle's own sampler against vLLM (`--sampler vllm`) on the same work.

    python bench/sampling_backends.py            # tiny and small models, 32 new tokens
    python bench/sampling_backends.py --quick    # the tiny model, 16 new tokens, 2 rounds

Needs the vLLM virtualenv (`make vllm-venv`, or --vllm-python). The same requests go to
both sides: Treadle's DecodeBatch on the engine in this process, and the worker's vLLM path
(VllmDecodeBatch: the vLLM process over its socket, LoRAs pushed from the engine's
snapshots, base rows on the zero adapter), fp32, temperature 1, EOS ignored, a fixed number
of new tokens per row. Rounds alternate between the two and medians are compared; each
figure is vLLM's tokens/s over Treadle's (> 1: vLLM is faster). Both sides use one thread.

- one_adapter_b{8,32}: requests on one LoRA snapshot (rank 16), batch 8 / 32.
- base_b8: base-model requests (vLLM runs them on the zero adapter, see sampler.py).
- mixed_b32: 32 requests over 3 snapshots and the base model.
- grpo_4x8: 4 prompts x num_samples 8 on one snapshot (the RL shape).
- gate_check_over_sample: one parity check (Treadle scoring 2 samples of a request) over
  sampling that request on vLLM: what the gate adds to a checked result.

Stdout ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from treadle.engine import Engine
from treadle.engine.tiny import make_tiny_model
from treadle.engine.types import LoraSpec, SampleRequest, SampleSpec
from treadle.worker.vllm.batch import VllmDecodeBatch
from treadle.worker.vllm.gate import ParityGate, thresholds_for
from treadle.worker.vllm.process import VllmSettings, find_python
from treadle.worker.vllm.sampler import VllmSampler


def snapshots(engine: Engine, n: int, rank: int = 16) -> list[str]:
    out = []
    for i in range(n):
        engine.create_adapter(f"m{i}", LoraSpec(rank=rank, alpha=2.0 * rank))
        gen = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for pair in engine.bank.get(f"m{i}").layers.values():
                pair.B.copy_(torch.randn(pair.B.shape, generator=gen) * 0.05)
        engine.snapshot(f"m{i}", f"snap:m{i}")
        out.append(f"snap:m{i}")
    return out


def requests(adapters: list[str | None], new: int, n: int = 1) -> list[SampleRequest]:
    rng = np.random.default_rng(0)
    spec = SampleSpec(max_tokens=new, temperature=1.0, seed=1, stop_at_eos=False)
    return [
        SampleRequest(rng.integers(3, 400, int(rng.integers(16, 48))).tolist(), n, spec, a)
        for a in adapters
    ]


def run(batch, reqs: list[SampleRequest]) -> float:
    """Seconds to sample every request to its end."""
    t0 = time.perf_counter()
    handles = batch.add(reqs)
    done: dict = {}
    while len(done) < len(handles):
        done.update(batch.step(until=lambda: batch.has_results))
    return time.perf_counter() - t0


def compare(engine, sampler, name, reqs, rounds, out) -> None:
    tokens = sum(r.num_samples * r.params.max_tokens for r in reqs)
    ours, theirs = [], []
    run(VllmDecodeBatch(engine, sampler), reqs)  # warm-up: LoRAs pushed, kernels built
    run(engine.decode_batch(), reqs)
    for _ in range(rounds):
        ours.append(run(engine.decode_batch(), reqs))
        theirs.append(run(VllmDecodeBatch(engine, sampler), reqs))
    t_ours, t_theirs = statistics.median(ours), statistics.median(theirs)
    out[name] = round(t_ours / t_theirs, 3)
    print(
        f"{name}: Treadle {tokens / t_ours:.0f} tok/s, vLLM {tokens / t_theirs:.0f} tok/s "
        f"-> vLLM / Treadle {out[name]}",
        flush=True,
    )


def bench_model(size: str, new: int, rounds: int, python: str, out: dict) -> None:
    model = make_tiny_model(Path(tempfile.mkdtemp()) / f"tiny-{size}", arch="llama", size=size)
    engine = Engine(model)
    settings = VllmSettings(python, str(model), max_loras=4, max_lora_rank=16,
                            max_model_len=1024, kv_cache_gb=0.5)  # fmt: skip
    gate = ParityGate(thresholds_for("float32"), enabled=False)  # its cost: measured apart
    sampler = VllmSampler(engine, settings, gate)
    sampler.start(wait=True)
    out[f"{size}_vllm_startup_s"] = round(sampler.process.startup_s, 1)
    try:
        snaps = snapshots(engine, 3)
        for s in snaps:
            sampler.push(s)
        for b in [8, 32]:
            compare(engine, sampler, f"{size}_one_adapter_b{b}", requests([snaps[0]] * b, new),
                    rounds, out)  # fmt: skip
        compare(engine, sampler, f"{size}_base_b8", requests([None] * 8, new), rounds, out)
        mixed = [[*snaps, None][i % 4] for i in range(32)]
        compare(engine, sampler, f"{size}_mixed_b32", requests(mixed, new), rounds, out)
        compare(engine, sampler, f"{size}_grpo_4x8", requests([snaps[0]] * 4, new, 8), rounds, out)
        # the gate: a check of one request's result against sampling it
        req = requests([snaps[1]], new, 2)
        batch = VllmDecodeBatch(engine, sampler)
        t0 = time.perf_counter()
        h = batch.add(req)[0]
        result = None
        while result is None:
            result = dict(batch.step(until=lambda: batch.has_results)).get(h)
        t_sample = time.perf_counter() - t0
        t0 = time.perf_counter()
        seqs = [(s.tokens, s.logprobs) for s in result.sequences]
        verdict = ParityGate(thresholds_for("float32")).check(
            engine, snaps[1], snaps[1], req[0].prompt, seqs
        )
        out[f"{size}_gate_check_over_sample"] = round((time.perf_counter() - t0) / t_sample, 3)
        out[f"{size}_parity_max_abs"] = float(f"{verdict.max_abs:.3g}")
    finally:
        sampler.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--vllm-python", default=None)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    python = find_python(args.vllm_python)
    new, rounds = (16, 2) if args.quick else (32, args.rounds)
    out: dict = {"bench": "sampling_backends", "new_tokens": new, "rounds": rounds}
    for size in ["tiny"] if args.quick else ["tiny", "small"]:
        bench_model(size, new, rounds, python, out)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
