"""Prefix cache benchmark: prefill time of a request whose prompt starts like an earlier one,
with the engine's prefix cache over without it, on the "small" tiny model (11M).

    python bench/prefix_cache.py            # 512-token prompts, 7 rounds
    python bench/prefix_cache.py --quick    # 256-token prompts, 3 rounds

Prefill time is the time of DecodeBatch.add (the prompt's forward and its rows' setup),
with num_samples 8 and a snapshot adapter, as in an RL loop. Each round times the cached
engine (its cache cleared, the first request added, then the timed second one) and an
engine without a cache on the same second request, alternately; the medians are compared.

- second_turn_vs_uncached: the next turn of a conversation: the first turn's prompt, a
  64-token reply and a 32-token user message (the first prompt is what the cache holds).
- second_grpo_vs_uncached: the same prompt again (the next GRPO request of a group).

Stdout ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from treadle.engine import Engine
from treadle.engine.sample import DecodeBatch
from treadle.engine.tiny import make_tiny_model
from treadle.engine.types import LoraSpec, SampleRequest, SampleSpec


def _adapter(engine: Engine) -> None:
    """A rank-8 snapshot, the same on every engine (B seeded nonzero: it changes the output)."""
    engine.create_adapter("ad", LoraSpec(rank=8, seed=0))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for pair in engine.bank.live("ad").layers.values():  # in path order
            pair.B.copy_(torch.randn(pair.B.shape, generator=gen) * 0.02)
    engine.snapshot("ad", "snap")


def _add_time(engine: Engine, req: SampleRequest) -> float:
    batch = DecodeBatch(engine)
    t0 = time.perf_counter()
    batch.add([req])
    return time.perf_counter() - t0


def run(quick: bool = False) -> dict[str, float]:
    torch.manual_seed(0)
    P, rounds = (256, 3) if quick else (512, 7)
    path = make_tiny_model(tempfile.mkdtemp(), arch="llama", size="small")
    cached, plain = Engine(path), Engine(path, prefix_cache_bytes=0)
    _adapter(cached)
    _adapter(plain)
    V = cached.vocab_size
    turn1 = torch.randint(3, V, (P,)).tolist()
    turn2 = turn1 + torch.randint(3, V, (64 + 32,)).tolist()

    def req(prompt: list[int]) -> SampleRequest:
        return SampleRequest(prompt, 8, SampleSpec(max_tokens=16, seed=1), adapter="snap")

    out: dict[str, float] = {}
    for name, second in (("second_turn", turn2), ("second_grpo", turn1)):
        hit, miss = [], []
        _add_time(plain, req(second))  # warm both paths once
        for _ in range(rounds):
            cached.prefix_cache.clear()
            _add_time(cached, req(turn1))
            hit.append(_add_time(cached, req(second)))
            miss.append(_add_time(plain, req(second)))
        ratio = statistics.median(hit) / statistics.median(miss)
        out[f"{name}_vs_uncached"] = round(ratio, 3)
        print(f"{name}: prefill with the cache / without = {ratio:.3f} (prompt {len(second)})")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="256-token prompts, 3 rounds")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(json.dumps(run(args.quick)))


if __name__ == "__main__":
    main()
