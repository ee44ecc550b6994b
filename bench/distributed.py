"""Worker groups: what do N ranks buy over one process, for training and for sampling?

    python bench/distributed.py                       # CPU, gloo: 1 process vs 2 ranks (none, fsdp)
    python bench/distributed.py --quick               # fewer, shorter steps
    python bench/distributed.py --device cuda --ranks 4 --dtype bfloat16 --model /models/m \\
        --rows 16 --seq-len 512                       # GPUs, NCCL: 1 GPU vs 4 (none, fsdp)

Each configuration runs in fresh processes spawned here (torch.multiprocessing; rank r of a
GPU run uses cuda:r): first one process with a plain Engine, then a group of N ranks
through DistributedEngine, as `treadle serve --devices N [--shard fsdp]` runs it. Every
configuration does the same work: S sessions whose batches share one forward_backward
call (rows x seq-len tokens each), then one optim_step per session; then one sample call
of S x 4 seeded requests (whole generations), and the same requests through the engine's
continuous decode batch, the one the worker keeps (stepped 8 tokens at a time). The figures are tokens per second and their ratio to the one
process measured in the same run. A rank is one device: one GPU, or on a CPU one core
(--threads-per-rank 1, for the one process too), so N ranks have a ceiling of N x; the
scaling efficiency is speedup / N. Stdout ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.multiprocessing as mp


def batches(sessions: int, rows: int, T: int, vocab: int, seed: int):
    from treadle.engine.types import TrainBatch, TrainDatum

    rng = np.random.default_rng(seed)
    out = []
    for s in range(sessions):
        data = []
        for _ in range(rows):
            seq = rng.integers(0, vocab, T + 1)
            inputs = {"target_tokens": seq[1:], "weights": np.ones(T, np.float32)}
            data.append(TrainDatum(seq[:-1], inputs))
        out.append(TrainBatch(f"s{s}", data))
    return out


def requests(sessions: int, per: int, max_tokens: int):
    from treadle.engine.types import SampleRequest, SampleSpec

    return [
        SampleRequest(
            [1 + (7 * i) % 50, 2 + i % 11, 3],
            params=SampleSpec(max_tokens=max_tokens, temperature=1.0, seed=i, stop_at_eos=False),
            adapter=f"s{i % sessions}",
        )
        for i in range(sessions * per)
    ]


def measure(engine, args) -> dict:
    """The timed loop, on an Engine or rank 0's DistributedEngine."""
    from treadle.engine.types import AdamSpec, LoraSpec

    for s in range(args.sessions):
        engine.create_adapter(f"s{s}", LoraSpec(rank=args.lora_rank, alpha=32, seed=s))
    adam = AdamSpec(learning_rate=1e-4)
    step_s = []
    for step in range(args.steps + 1):  # the first is a warm-up
        data = batches(args.sessions, args.rows, args.seq_len, engine.vocab_size, step)
        _sync(args.device)
        t = time.perf_counter()
        engine.forward_backward(data)
        for s in range(args.sessions):
            engine.optim_step(f"s{s}", adam)
        _sync(args.device)
        if step:
            step_s.append(time.perf_counter() - t)
    reqs = requests(args.sessions, 4, args.max_tokens)
    engine.sample(reqs[:2])  # warm-up
    _sync(args.device)
    t = time.perf_counter()
    results = engine.sample(reqs)
    _sync(args.device)
    sample_s = time.perf_counter() - t
    sampled = sum(len(q.tokens) for r in results for q in r.sequences)
    decode_s = _decode(engine, reqs[:2], args.device)  # warm-up
    decode_s = _decode(engine, reqs, args.device)
    tokens = args.sessions * args.rows * args.seq_len
    return {
        "train_tokens_per_s": tokens / statistics.median(step_s),
        "sample_tokens_per_s": sampled / sample_s,
        "decode_tokens_per_s": sampled / decode_s,
        "memory_bytes": _memory(args.device),
    }


def _decode(engine, reqs, device: str) -> float:
    """Seconds for the requests through the engine's continuous decode batch (what the
    worker keeps between rounds), stepped 8 tokens at a time as a busy worker yields."""
    batch = engine.decode_batch()
    _sync(device)
    t = time.perf_counter()
    batch.add(reqs)
    while len(batch):
        batch.step(max_steps=8)
    _sync(device)
    return time.perf_counter() - t


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _memory(device: str) -> int | None:
    return int(torch.cuda.max_memory_allocated()) if device.startswith("cuda") else None


def one_process(rank: int, args, out: str) -> None:
    torch.set_num_threads(args.threads_per_rank)
    from treadle.engine import Engine

    device = "cuda:0" if args.device.startswith("cuda") else "cpu"
    engine = Engine(args.model, dtype=args.dtype, device=device)
    Path(out).write_text(json.dumps(measure(engine, args)))


def group_rank(rank: int, args, shard: str, port: int, out: str) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(args.ranks), LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    torch.set_num_threads(args.threads_per_rank)
    import torch.distributed as dist

    from treadle.engine import Engine
    from treadle.engine.distributed import DistributedEngine, init_group

    group = init_group(args.device, shard)
    load_on = "cpu" if group.fsdp else str(group.device)
    engine = DistributedEngine(Engine(args.model, dtype=args.dtype, device=load_on), group)
    if group.leader:
        figures = measure(engine, args)
        engine.release()
        Path(out).write_text(json.dumps(figures))
    else:
        engine.follow()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="an HF folder or .gguf (default: a 'small' tiny model)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--shards", default="none,fsdp", help="group configurations to run")
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--rows", type=int, default=4, help="rows per session per call")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--threads-per-rank", type=int, default=1, help="CPU threads of each process")
    p.add_argument("--rounds", type=int, default=2, help="runs of each configuration (medians)")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.steps, args.rows, args.seq_len, args.max_tokens, args.rounds = 2, 2, 64, 16, 1
    # as `treadle serve` does: libgomp's default spin-wait makes a busy machine crawl
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", "10000")
    work = Path(tempfile.mkdtemp(prefix="bench-distributed-"))
    if args.model is None:
        from treadle.engine.tiny import make_tiny_model

        args.model = str(make_tiny_model(work / "small", arch="llama", size="small"))
    ceiling = args.ranks
    configs = ["1", *(f"{args.ranks}-{s}" for s in args.shards.split(",") if s)]
    runs: dict[str, list[dict]] = {c: [] for c in configs}
    load = [os.getloadavg()[0]]
    for r in range(args.rounds):  # the order rotates: a noisy minute hits every configuration
        for name in configs[r % len(configs) :] + configs[: r % len(configs)]:
            out = str(work / f"{name}-{r}.json")
            if name == "1":
                mp.spawn(one_process, args=(args, out), nprocs=1)
            else:
                shard = name.split("-", 1)[1]
                mp.spawn(group_rank, args=(args, shard, free_port(), out), nprocs=args.ranks)
            runs[name].append(json.loads(Path(out).read_text()))
    load.append(os.getloadavg()[0])
    figures = {
        name: {
            k: statistics.median(f[k] for f in fs)
            for k in ("train_tokens_per_s", "sample_tokens_per_s", "decode_tokens_per_s")
        }
        | {"memory_bytes": fs[0]["memory_bytes"]}
        for name, fs in runs.items()
    }
    base = figures["1"]
    print(
        f"{'configuration':<14} {'train tok/s':>12} {'speedup':>8} {'sample tok/s':>13} "
        f"{'speedup':>8} {'decode tok/s':>13} {'speedup':>8}"
    )
    result: dict = {"bench": "distributed", "device": args.device, "ranks": args.ranks,
                    "ceiling": ceiling, "rounds": args.rounds, "load_avg": load, "configs": {}}  # fmt: skip
    for name, f in figures.items():
        train = f["train_tokens_per_s"] / base["train_tokens_per_s"]
        sample = f["sample_tokens_per_s"] / base["sample_tokens_per_s"]
        decode = f["decode_tokens_per_s"] / base["decode_tokens_per_s"]
        print(
            f"{name:<14} {f['train_tokens_per_s']:>12.0f} {train:>7.2f}x "
            f"{f['sample_tokens_per_s']:>13.0f} {sample:>7.2f}x "
            f"{f['decode_tokens_per_s']:>13.0f} {decode:>7.2f}x"
        )
        result["configs"][name] = {
            **f,
            "train_speedup": round(train, 3),
            "sample_speedup": round(sample, 3),
            "decode_speedup": round(decode, 3),
            "train_efficiency": round(train / (1 if name == "1" else ceiling), 3),
            "sample_efficiency": round(sample / (1 if name == "1" else ceiling), 3),
        }
    sys.stdout.flush()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
