"""The engine on a GPU against plain torch + peft and `model.generate`, on a random-weight
Llama of realistic size built on the spot (no weights need fetching), in bfloat16.

    python bench/gpu.py                   # on a CUDA machine: a ~0.8B Llama, about 5 minutes
    python bench/gpu.py --size 3b         # a ~3B one
    python bench/gpu.py --cpu-check       # tiny sizes on the CPU: does the script run?

Questions, each a ratio measured in this run (the two sides alternate, medians compared):
- forward_backward tokens/s, the engine (LoRA rank 16 on every linear layer) against
  plain torch + peft on the same base (bench/baseline.py: the same targets, unembedding
  included, one fused cross entropy over the fp32 logits as the engine's loss; batch
  --fb-batch x --fb-len);
- sampling tokens/s against `model.generate` at batch 1 / 32 / 256 (base weights, T=1,
  --new-tokens tokens after a --prompt-len prompt, no early stop);
- one batch mixing 8 and 64 adapters against the same rows on one adapter, for
  forward_backward and for sampling (every row its own adapter's numbers).
Writes gpu.json into $OUT when that is set, and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import baseline
import numpy as np
import torch

from treadle.engine import Engine
from treadle.engine.tiny import make_tiny_model
from treadle.engine.types import LoraSpec, SampleRequest, SampleSpec, TrainBatch, TrainDatum

# hidden, layers, heads, kv heads, intermediate, vocab
SIZES = {
    "check": (64, 2, 4, 2, 128, 1024),
    "1b": (2048, 16, 16, 8, 5632, 32000),  # ~0.8B with tied embeddings
    "3b": (3072, 26, 24, 8, 8192, 32000),  # ~3B
}


def build_model(out: Path, size: str, device: str) -> Path:
    """A Llama folder of the given shape: make-tiny-model's tokenizer and template, random
    weights made on the device (bf16) and saved as safetensors."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    make_tiny_model(out, arch="llama", size="tiny")
    hidden, layers, heads, kv, inter, vocab = SIZES[size]
    base = json.loads((out / "config.json").read_text())
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=base["eos_token_id"],
        pad_token_id=base["pad_token_id"],
        bos_token_id=None,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    for f in out.glob("*.safetensors"):
        f.unlink()
    model.save_pretrained(out)
    del model
    return out


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def alternate(fns: dict, repeats: int, device: str) -> dict[str, float]:
    """Median seconds of each function, run in turn after one warm-up each."""
    for fn in fns.values():
        fn()
    sync(device)
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def sft_rows(vocab: int, B: int, T: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, vocab, (B, T + 1))  # (B, T+1)


def datums(rows: np.ndarray) -> list[TrainDatum]:
    w = np.ones(rows.shape[1] - 1, np.float32)
    return [TrainDatum(r[:-1], {"target_tokens": r[1:], "weights": w}) for r in rows]


def bench_fb(engine: Engine, model_dir: Path, args, device: str) -> dict:
    from transformers import AutoModelForCausalLM

    B, T, rank = args.fb_batch, args.fb_len, args.rank
    engine.create_adapter("fb", LoraSpec(rank=rank, alpha=2.0 * rank))
    rows = sft_rows(engine.vocab_size, B, T, seed=0)
    batch = [TrainBatch("fb", datums(rows))]
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device)
    peft_model = baseline.lora_model(base, rank, 2.0 * rank)  # bench/baseline.py
    ids = torch.as_tensor(rows[:, :-1], device=device)  # (B, T)
    targets = torch.as_tensor(rows[:, 1:], device=device)  # (B, T)

    def theirs():
        baseline.ce_forward_backward(peft_model, ids, targets)

    fns = {"engine": lambda: engine.forward_backward(batch), "peft": theirs}
    t = alternate(fns, args.repeats, device)
    engine.drop_adapter("fb")
    return {
        "fb_engine_tokens_per_s": round(B * T / t["engine"]),
        "fb_peft_tokens_per_s": round(B * T / t["peft"]),
        "fb_vs_peft": round(t["peft"] / t["engine"], 3),
    }


def bench_sampling(engine: Engine, model_dir: Path, args, device: str) -> dict:
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device)
    plain.eval().requires_grad_(False)
    plain.generation_config.eos_token_id = None  # --new-tokens every time, as the engine
    P, N = args.prompt_len, args.new_tokens
    spec = SampleSpec(max_tokens=N, temperature=1.0, stop_at_eos=False)
    out: dict = {}
    for B in args.sample_batches:
        prompts = np.random.default_rng(B).integers(3, engine.vocab_size, (B, P))  # (B, P)
        requests = [SampleRequest(p.tolist(), 1, spec) for p in prompts]
        ids = torch.as_tensor(prompts, device=device)

        def generate(ids=ids):
            with torch.no_grad():
                plain.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=True,
                    top_k=0,
                    top_p=1.0,
                    max_new_tokens=N,
                    pad_token_id=0,
                )

        fns = {"engine": lambda r=requests: engine.sample(r), "generate": generate}
        t = alternate(fns, max(2, args.repeats // 3), device)
        out[f"sample_b{B}_engine_tokens_per_s"] = round(B * N / t["engine"])
        out[f"sample_b{B}_generate_tokens_per_s"] = round(B * N / t["generate"])
        out[f"sample_b{B}_vs_generate"] = round(t["generate"] / t["engine"], 3)
    return out


def bench_mixed(engine: Engine, args, device: str) -> dict:
    """One call whose rows belong to 8 / 64 adapters against the same rows on one adapter."""
    rows_n = max(args.mixed_adapters)
    ids = [f"mix-{i}" for i in range(rows_n)]
    for i, aid in enumerate(ids):
        engine.create_adapter(aid, LoraSpec(rank=args.rank, seed=i))
        engine.snapshot(aid, f"snap-{aid}")
    data = datums(sft_rows(engine.vocab_size, rows_n, args.mixed_len, seed=1))
    P, N = args.prompt_len, args.new_tokens
    spec = SampleSpec(max_tokens=N, temperature=1.0, stop_at_eos=False)
    prompts = np.random.default_rng(2).integers(3, engine.vocab_size, (rows_n, P))
    out: dict = {}
    for n in args.mixed_adapters:
        per = rows_n // n
        mixed = [TrainBatch(ids[i], data[i * per : (i + 1) * per]) for i in range(n)]
        one = [TrainBatch(ids[0], data)]

        def sample(n_adapters: int):
            return lambda: engine.sample(
                [
                    SampleRequest(
                        p.tolist(), 1, spec, adapter=f"snap-{ids[i // (rows_n // n_adapters)]}"
                    )
                    for i, p in enumerate(prompts)
                ]  # fmt: skip
            )

        t = alternate(
            {
                "fb_mixed": lambda m=mixed: engine.forward_backward(m),
                "fb_one": lambda o=one: engine.forward_backward(o),
                "sample_mixed": sample(n),
                "sample_one": sample(1),
            },
            max(2, args.repeats // 3),
            device,
        )
        out[f"mixed{n}_fb_vs_one"] = round(t["fb_one"] / t["fb_mixed"], 3)
        out[f"mixed{n}_sample_vs_one"] = round(t["sample_one"] / t["sample_mixed"], 3)
        out[f"mixed{n}_fb_tokens_per_s"] = round(rows_n * args.mixed_len / t["fb_mixed"])
        out[f"mixed{n}_sample_tokens_per_s"] = round(rows_n * N / t["sample_mixed"])
    for aid in ids:
        engine.drop_snapshot(f"snap-{aid}")
        engine.drop_adapter(aid)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-check", action="store_true", help="tiny sizes on the CPU")
    ap.add_argument("--size", default="1b", choices=["1b", "3b"])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--fb-batch", type=int, default=8)
    ap.add_argument("--fb-len", type=int, default=1024)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--sample-batches", type=int, nargs="+", default=[1, 32, 256])
    ap.add_argument("--mixed-adapters", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--mixed-len", type=int, default=256, help="tokens per row, mixed fb")
    ap.add_argument("--repeats", type=int, default=6)
    args = ap.parse_args()
    if args.cpu_check:
        size, device = "check", "cpu"
        args.fb_batch, args.fb_len, args.prompt_len, args.new_tokens = 2, 32, 8, 8
        args.sample_batches, args.mixed_len, args.repeats = [1, 4], 16, 2
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --cpu-check for the CPU self-check")
        size, device = args.size, "cuda"
    result: dict = {"bench": "gpu", "size": size, "device": device}
    if device == "cuda":
        result["gpu"] = torch.cuda.get_device_name(0)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        model_dir = build_model(Path(tmp) / "model", size, device)
        engine = Engine(model_dir, dtype="bfloat16", device=device)
        result["build_s"] = round(time.perf_counter() - t0, 1)
        result["params"] = sum(p.numel() for p in engine.model.parameters())
        print(f"model: {result['params'] / 1e9:.2f}B parameters, built in {result['build_s']} s")
        for part in (bench_fb, bench_sampling):
            result |= part(engine, model_dir, args, device)
            if device == "cuda":
                torch.cuda.empty_cache()  # the baseline's model is gone
            print({k: v for k, v in result.items() if k not in ("bench",)}, flush=True)
        result |= bench_mixed(engine, args, device)
    result |= {k: v for k, v in vars(args).items() if k not in ("cpu_check", "size")}
    if os.environ.get("OUT"):  # the device tool brings back what is written there
        (Path(os.environ["OUT"]) / "gpu.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
