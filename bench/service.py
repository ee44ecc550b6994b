"""What the service costs: an SFT loop through `treadle serve` against the same loop on the
engine in-process, and the round-trip overhead of a minimal call.

    .venv/bin/python bench/service.py                    # small tiny-llama, 10 steps
    .venv/bin/python bench/service.py --quick              # 4x64 batches, one round

Both loops run the same batches (random tokens, weight 1) with the same LoRA settings; the
service loop submits forward_backward and optim_step together and waits for both each step,
as a user's loop does. Modes alternate for --rounds rounds and the best time of each mode is
kept, so that one noisy moment of a shared machine does not decide the ratio.

Goals: sft_ratio = in-process time / service time >= 0.9; overhead of a minimal call
(service round trip minus the engine's own time for it) <= 5 ms over loopback.
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from treadle import AdamParams, Datum, ModelInput, ServiceClient
from treadle.engine.engine import Engine
from treadle.engine.tiny import make_tiny_model
from treadle.engine.types import AdamSpec, LoraSpec, TrainBatch, TrainDatum
from treadle.launch import ServerProcess

NAME = "bench/tiny-llama-small"


def make_batches(steps: int, batch: int, seq_len: int, vocab: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, vocab, (batch, seq_len + 1)) for _ in range(steps)]  # (B, T+1)


def median_ms(fn: Callable[[], object], n: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


# ---- in-process ------------------------------------------------------------------------------


def engine_batch(tokens_BT: np.ndarray, adapter: str) -> TrainBatch:
    data = [
        TrainDatum(
            tokens=row[:-1],
            loss_inputs={"target_tokens": row[1:], "weights": np.ones(len(row) - 1, np.float32)},
        )
        for row in tokens_BT
    ]
    return TrainBatch(adapter_id=adapter, data=data, loss_fn="cross_entropy")


def run_engine(engine: Engine, batches: list[np.ndarray], spec: LoraSpec, adam: AdamSpec) -> float:
    engine.create_adapter("bench", spec)
    engine.forward_backward([engine_batch(batches[0], "bench")])  # warm-up
    engine.optim_step("bench", adam)
    t0 = time.perf_counter()
    for tokens_BT in batches:
        engine.forward_backward([engine_batch(tokens_BT, "bench")])
        engine.optim_step("bench", adam)
    elapsed = time.perf_counter() - t0
    engine.drop_adapter("bench")
    return elapsed


def engine_minimal_ms(engine: Engine, spec: LoraSpec, adam: AdamSpec, n: int) -> dict[str, float]:
    engine.create_adapter("tiny-call", spec)
    one = TrainBatch(
        adapter_id="tiny-call",
        data=[
            TrainDatum(
                np.array([1]), {"target_tokens": np.array([2]), "weights": np.ones(1, np.float32)}
            )
        ],
    )
    out = {
        "forward1": median_ms(lambda: engine.forward_backward([one], forward_only=True), n),
        "optim": median_ms(lambda: engine.optim_step("tiny-call", adam), n),
    }
    engine.drop_adapter("tiny-call")
    return out


# ---- through the service ---------------------------------------------------------------------


def sdk_batch(tokens_BT: np.ndarray) -> list[Datum]:
    return [
        Datum(
            model_input=ModelInput.from_ints(row[:-1].tolist()),
            loss_fn_inputs={"target_tokens": row[1:], "weights": np.ones(len(row) - 1, np.float32)},
        )
        for row in tokens_BT
    ]


def run_service(
    svc: ServiceClient, batches: list[np.ndarray], spec: LoraSpec, adam: AdamParams
) -> float:
    data = [sdk_batch(b) for b in batches]  # built outside the timed loop, as in-process
    with svc.create_lora_training_client(
        NAME, rank=spec.rank, alpha=spec.alpha, seed=spec.seed
    ) as tc:
        tc.forward_backward(data[0]).result()  # warm-up
        tc.optim_step(adam).result()
        t0 = time.perf_counter()
        for batch in data:
            fb = tc.forward_backward(batch)
            op = tc.optim_step(adam)
            fb.result()
            op.result()
        return time.perf_counter() - t0


def service_minimal_ms(
    svc: ServiceClient, spec: LoraSpec, adam: AdamParams, n: int
) -> dict[str, float]:
    with svc.create_lora_training_client(NAME, rank=spec.rank, alpha=spec.alpha) as tc:
        one = [
            Datum(
                model_input=ModelInput.from_ints([1]),
                loss_fn_inputs={"target_tokens": [2], "weights": [1.0]},
            )
        ]
        info = {"model_id": tc.model_id}
        return {
            "forward1": median_ms(lambda: tc.forward(one).result(), n),
            "optim": median_ms(lambda: tc.optim_step(adam).result(), n),
            # a direct call: HTTP and the route only, no engine, no queue
            "get_info": median_ms(
                lambda: svc.transport.call(svc.transport.post("/api/v1/get_info", info)), n
            ),
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2, help="alternations of the two modes")
    ap.add_argument("--calls", type=int, default=30, help="repeats of each minimal call")
    ap.add_argument("--quick", action="store_true", help="batch 4, seq-len 64, one round")
    args = ap.parse_args()
    if args.quick:
        args.batch, args.seq_len, args.rounds, args.calls = 4, 64, 1, 10

    spec = LoraSpec(rank=args.rank, alpha=float(args.rank), seed=0)
    adam_spec = AdamSpec(learning_rate=1e-4)
    adam = AdamParams(learning_rate=1e-4)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / "model", "llama", "small")
        engine = Engine(model_dir)
        batches = make_batches(args.steps, args.batch, args.seq_len, engine.vocab_size)
        inproc, service = [], []
        with ServerProcess({NAME: model_dir}, Path(tmp) / "data") as server:
            svc = ServiceClient(base_url=server.url)
            for _ in range(args.rounds):
                inproc.append(run_engine(engine, batches, spec, adam_spec))
                gc.collect()
                service.append(run_service(svc, batches, spec, adam))
            engine_ms = engine_minimal_ms(engine, spec, adam_spec, args.calls)
            service_ms = service_minimal_ms(svc, spec, adam, args.calls)
            svc.close()

    tokens = args.steps * args.batch * args.seq_len
    t_in, t_svc = min(inproc), min(service)
    overhead = {k: service_ms[k] - engine_ms[k] for k in engine_ms}
    print(f"SFT loop, {args.steps} steps of {args.batch}x{args.seq_len} tokens, small tiny-llama:")
    print(f"  in-process engine  {t_in:7.2f} s  {tokens / t_in:8.0f} tokens/s   (runs: {inproc})")
    print(
        f"  through service    {t_svc:7.2f} s  {tokens / t_svc:8.0f} tokens/s   (runs: {service})"
    )
    print(f"  ratio in-process/service = {t_in / t_svc:.3f}   (goal >= 0.9)")
    print("minimal calls, median ms (service round trip | engine alone | overhead):")
    for k in engine_ms:
        print(f"  {k:10s} {service_ms[k]:8.2f} | {engine_ms[k]:8.2f} | {overhead[k]:8.2f}")
    print(f"  get_info   {service_ms['get_info']:8.2f} (direct call, no engine)")
    print("  goal: overhead <= 5 ms")
    result = {
        "bench": "service",
        "steps": args.steps,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "sft_inproc_s": round(t_in, 3),
        "sft_service_s": round(t_svc, 3),
        "sft_ratio": round(t_in / t_svc, 3),
        "overhead_forward1_ms": round(overhead["forward1"], 2),
        "overhead_optim_ms": round(overhead["optim"], 2),
        "get_info_ms": round(service_ms["get_info"], 2),
        "service_forward1_ms": round(service_ms["forward1"], 2),
        "engine_forward1_ms": round(engine_ms["forward1"], 2),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
