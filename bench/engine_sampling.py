"""Sampling benchmark: treadle.engine.sample against HF `generate`, on the "small" tiny model
(or the model of `bench/engine.py --model PATH` / `--arch ARCH`, through run(model=...)).

    python bench/engine_sampling.py            # 64 new tokens per row, 5 rounds
    python bench/engine_sampling.py --quick    # 16 new tokens per row, 2 rounds

Each figure is a ratio measured in this run: rounds alternate between the sampler and its
baseline, and the medians are compared (the machine is noisy; never compare bare times).
On a busy 2-core machine OMP_NUM_THREADS=1 gives steadier figures for both sides.

- sample_vs_generate_b{1,8,32}: our tokens/s over `model.generate(do_sample=True)` on the
  same prompts (distinct, 16-48 tokens), temperature 1, no top-k / top-p, EOS ignored, a
  fixed number of new tokens. Goal >= 1.0 at batch 32.
- mixed_adapters_vs_one: tokens/s of 8 requests on 8 different adapters over 8 requests on
  one adapter (rank 32, all linear layers). Goal: close to 1. Bound by memory here: each
  decode step reads every adapter once, and 8 rank-32 adapters hold more weights (8 x 1.6M)
  than this base model (11M). mixed_adapters_vs_one_r8: the same with rank-8 adapters
  (8 x 0.4M: the proportion of rank-32 adapters to a 1B model's weights is smaller still).
- grouped_adapters_vs_one: the RL shape, 4 requests x num_samples 8 on 4 adapters over the
  same on one adapter. Goal: close to 1.
- one_adapter_vs_base: tokens/s of 8 requests on one adapter over the base model (context).
- shared_prefill_8_vs_1: prefill time (forward + cache expansion to 8 rows) of one request
  with num_samples=8 over one plain forward of its prompt. Goal <= 1.1.
- separate_prefills_8_vs_1: a batch-8 forward of the same prompt over one (what sharing saves).

Also run by bench/engine.py through run(quick). Stdout ends with one JSON line.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

import treadle.engine.sample as S
from treadle.engine import Engine
from treadle.engine.tiny import make_tiny_model
from treadle.engine.types import LoraSpec, SampleRequest, SampleSpec


def random_prompts(n: int, vocab: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (m,), generator=g).tolist() for m in lens]


def alternate(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median seconds of each fn, run in turns (after one warm-up each)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def hf_generate(model, prompts: list[list[int]], new_tokens: int) -> None:
    """The baseline: left-padded batch, plain sampling, EOS off, exactly new_tokens each."""
    T = max(map(len, prompts))
    ids = torch.tensor([[0] * (T - len(p)) + p for p in prompts])  # (B, T)
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])  # (B, T)
    cfg = copy.deepcopy(model.generation_config)
    cfg.update(
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=None, pad_token_id=0,
        max_new_tokens=new_tokens, min_new_tokens=None,
    )  # fmt: skip
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, generation_config=cfg)
    assert out.shape[1] == T + new_tokens, out.shape


def sampler_requests(
    prompts: list[list[int]],
    new_tokens: int,
    adapters: list[str | None] | None = None,
    num_samples: int = 1,
) -> list[SampleRequest]:
    spec = dict(max_tokens=new_tokens, temperature=1.0, stop_at_eos=False)
    adapters = adapters or [None] * len(prompts)
    return [
        SampleRequest(p, num_samples, params=SampleSpec(seed=i, **spec), adapter=a)
        for i, (p, a) in enumerate(zip(prompts, adapters, strict=True))
    ]


def bench_vs_generate(engine: Engine, new_tokens: int, rounds: int) -> dict[str, float]:
    out = {}
    for batch in (1, 8, 32):
        prompts = random_prompts(batch, engine.vocab_size, 16, 48, seed=batch)
        reqs = sampler_requests(prompts, new_tokens)
        t = alternate(
            {
                "ours": lambda reqs=reqs: engine.sample(reqs),
                "generate": lambda p=prompts: hf_generate(engine.model, p, new_tokens),
            },
            rounds,
        )
        out[f"sample_vs_generate_b{batch}"] = t["generate"] / t["ours"]
        print(f"batch {batch:2d}: sampler / generate tokens/s = {t['generate'] / t['ours']:.2f}")
    return out


def bench_adapters(
    engine: Engine, new_tokens: int, rounds: int, rank: int = 32
) -> dict[str, float]:
    ids = [f"bench-{i}" for i in range(8)]
    for i, a in enumerate(ids):
        engine.create_adapter(a, LoraSpec(rank=rank, alpha=float(rank), seed=i))
    prompts = random_prompts(8, engine.vocab_size, 16, 48, seed=3)

    def groups(adapters: list[str]) -> None:  # 4 requests x 8 samples
        engine.sample(sampler_requests(prompts[:4], new_tokens, adapters, num_samples=8))

    t = alternate(
        {
            "mixed": lambda: engine.sample(sampler_requests(prompts, new_tokens, ids)),
            "one": lambda: engine.sample(sampler_requests(prompts, new_tokens, [ids[0]] * 8)),
            "base": lambda: engine.sample(sampler_requests(prompts, new_tokens)),
            "groups": lambda: groups(ids[:4]),
            "groups_one": lambda: groups([ids[0]] * 4),
        },
        rounds,
    )
    for a in ids:
        engine.drop_adapter(a)
    if rank != 32:  # the lighter adapters: only the 8-adapter figure
        out = {f"mixed_adapters_vs_one_r{rank}": t["one"] / t["mixed"]}
        print(f"rank {rank}: 8 adapters / 1 adapter tokens/s = {t['one'] / t['mixed']:.2f}")
        return out
    out = {
        "mixed_adapters_vs_one": t["one"] / t["mixed"],
        "one_adapter_vs_base": t["base"] / t["one"],
        "grouped_adapters_vs_one": t["groups_one"] / t["groups"],
    }
    print(
        f"rank 32: 8 adapters / 1 adapter tokens/s = {out['mixed_adapters_vs_one']:.2f}; "
        f"1 adapter / base = {out['one_adapter_vs_base']:.2f}; "
        f"4 adapters x 8 samples / 1 adapter = {out['grouped_adapters_vs_one']:.2f}"
    )
    return out


def bench_shared_prefill(engine: Engine, prompt_len: int, rounds: int) -> dict[str, float]:
    """Time the sampler's own prefill + cache expansion by wrapping those two steps."""
    prompt = random_prompts(1, engine.vocab_size, prompt_len, prompt_len, seed=7)[0]
    spent: list[float] = []

    def timed(fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            result = fn(*args, **kwargs)
            spent.append(time.perf_counter() - t0)
            return result

        return wrapper

    def shared() -> None:
        # max_tokens 2: the cache is built and expanded to 8 rows (1 would need no cache)
        req = SampleRequest(prompt, num_samples=8, params=SampleSpec(max_tokens=2, seed=0))
        engine.sample([req])

    def plain(rows: int) -> None:
        ids = torch.tensor([prompt] * rows, device=engine.device)  # (rows, T)
        with torch.inference_mode():
            engine.model(input_ids=ids, use_cache=True, logits_to_keep=1)

    prefill, expand = S._prefill, S.preallocate
    S._prefill, S.preallocate = timed(prefill), timed(expand)
    times: dict[str, list[float]] = {"shared": [], "one": [], "eight": []}
    try:
        for _ in range(rounds + 1):  # the first round warms up
            spent.clear()
            shared()
            times["shared"].append(sum(spent))
            for name, rows in (("one", 1), ("eight", 8)):
                t0 = time.perf_counter()
                plain(rows)
                times[name].append(time.perf_counter() - t0)
    finally:
        S._prefill, S.preallocate = prefill, expand
    t = {name: statistics.median(ts[1:]) for name, ts in times.items()}
    out = {
        "shared_prefill_8_vs_1": t["shared"] / t["one"],
        "separate_prefills_8_vs_1": t["eight"] / t["one"],
    }
    print(
        f"prefill of 8 samples / one prefill = {out['shared_prefill_8_vs_1']:.2f} "
        f"(8 separate prefills: {out['separate_prefills_8_vs_1']:.2f})"
    )
    return out


def run(quick: bool = False, model: str | None = None) -> dict:
    """All sampling figures as a dict of ratios (plus the settings they were measured with),
    on `model` (a folder or .gguf file; bench/engine.py --model / --arch) or the small tiny
    llama."""
    new_tokens, rounds, prompt_len = (16, 2, 128) if quick else (64, 5, 256)
    with tempfile.TemporaryDirectory() as tmp:
        engine = Engine(model or make_tiny_model(tmp, arch="llama", size="small"))
        result: dict = {"sampling_new_tokens": new_tokens, "sampling_rounds": rounds}
        # generate first, while no adapter hooks sit on the model's layers
        result |= bench_vs_generate(engine, new_tokens, rounds)
        result |= bench_shared_prefill(engine, prompt_len, rounds)
        result |= bench_adapters(engine, new_tokens, rounds)
        result |= bench_adapters(engine, new_tokens, rounds, rank=8)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run for smoke checks")
    args = parser.parse_args()
    print(json.dumps(run(quick=args.quick)))


if __name__ == "__main__":
    main()
