"""Sampling without head-of-line blocking: training beside a long generation, streaming, and
continuous batching.

    OMP_NUM_THREADS=1 .venv/bin/python bench/streaming.py   # the "tiny" model, 32 x 512 tokens
    OMP_NUM_THREADS=1 .venv/bin/python bench/streaming.py --quick       # 16 x 256, fewer rounds
    OMP_NUM_THREADS=1 .venv/bin/python bench/streaming.py --size small  # the 11M model

On a shared machine OMP_NUM_THREADS=1 (which the server inherits) keeps a busy neighbour
from turning each OpenMP barrier of the engine worker into a wait of its own.

Three questions, each answered by a ratio measured in this run (the machine is noisy):

- fb_busy_vs_idle: the round-trip latency of a small forward_backward (one 16-token datum)
  of one session while another session generates 32 x 512 tokens, over its latency on the
  idle server (medians; `treadle serve` with its engine worker, the treadle SDK). Goal <= 2.
  Also shown: how many forward_backward calls finished during one generation, and how long
  the generation took (what one call waited before, when a generation held the engine).
- first_chunk_share: time to the first chunk of a streamed 64-token /v1/completions answer
  over the time to its last chunk (official openai client; median of several). Goal <= 0.2.
- arrivals_vs_by_hand: sampler tokens/s when 32 requests (64 new tokens each) arrive one
  by one over the first quarter of the time the same requests take batched by hand into one
  Engine.sample call, over that by-hand figure (the engine loop in-process, no HTTP). Also
  shown: the same arrivals when each generation runs to its end before the next batch
  starts (the loop before continuous batching), over the by-hand figure.

Ends with one JSON line.
"""

from __future__ import annotations

import os

from treadle.server.main import OPENMP_SPIN_COUNT

if "OMP_WAIT_POLICY" not in os.environ:  # before torch loads; the server inherits it too
    os.environ.setdefault("GOMP_SPINCOUNT", OPENMP_SPIN_COUNT)

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from treadle import Datum, ModelInput, SamplingParams, ServiceClient  # noqa: E402
from treadle.engine.engine import Engine  # noqa: E402
from treadle.engine.tiny import make_tiny_model  # noqa: E402
from treadle.engine.types import SampleRequest, SampleSpec  # noqa: E402
from treadle.launch import ServerProcess  # noqa: E402
from treadle.protocol.facts import EngineFacts  # noqa: E402
from treadle.protocol.ops import Op, OpKind, Outcome, Sample  # noqa: E402
from treadle.worker.executor import OpExecutor  # noqa: E402
from treadle.worker.loop import EngineLoop  # noqa: E402

NAME = "bench/tiny-llama"


# ---- 1. a forward_backward beside a generation -----------------------------------------------


def fb_latency(url: str, rows: int, new_tokens: int, rounds: int) -> dict:
    with ServiceClient(base_url=url) as svc:
        tc = svc.create_lora_training_client(NAME, rank=8, seed=0)
        tokens = np.random.default_rng(0).integers(1, 500, 17).tolist()
        datum = Datum(
            model_input=ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 16},
        )

        def one_fb() -> float:
            t0 = time.perf_counter()
            tc.forward_backward([datum], "cross_entropy").result()
            return time.perf_counter() - t0

        for _ in range(3):
            one_fb()  # warm-up
        idle = [one_fb() for _ in range(rounds)]
        sampler = svc.create_sampling_client(base_model=NAME)
        prompt = ModelInput.from_ints([5, 6, 7, 8, 9, 10, 11, 12])
        # stop=[]: no EOS either, every row samples all new_tokens
        params = SamplingParams(max_tokens=new_tokens, temperature=1.0, seed=1, stop=[])
        busy: list[float] = []
        gen_s: list[float] = []
        for _ in range(2):  # two generations, fb calls back to back while each runs
            done = threading.Event()
            t0 = time.perf_counter()
            fut = sampler.sample(prompt, rows, params)
            waiter = threading.Thread(target=lambda f=fut, d=done: (f.result(), d.set()))
            waiter.start()
            time.sleep(0.2)  # the generation's prefill is over: it is decoding
            while not done.is_set():
                latency = one_fb()
                if not done.is_set():  # finished while the generation still ran
                    busy.append(latency)
            gen_s.append(time.perf_counter() - t0)
            waiter.join()
            sampled = sum(len(s.tokens) for s in fut.result().sequences)
    out = {
        "fb_idle_ms": 1000 * statistics.median(idle),
        "fb_busy_ms": 1000 * statistics.median(busy),
        "fb_during_generation": len(busy) / 2,
        "generation_s": statistics.median(gen_s),
        "generation_tokens": sampled,
    }
    out["fb_busy_vs_idle"] = out["fb_busy_ms"] / out["fb_idle_ms"]
    print(
        f"forward_backward while {rows} x {new_tokens} tokens are generated: "
        f"{out['fb_busy_ms']:.1f} ms vs {out['fb_idle_ms']:.1f} ms idle "
        f"(x{out['fb_busy_vs_idle']:.2f}; {out['fb_during_generation']:.0f} calls during one "
        f"{out['generation_s']:.1f} s generation)"
    )
    return out


# ---- 2. time to the first chunk of a stream ----------------------------------------------------


def first_chunk(url: str, new_tokens: int, rounds: int) -> dict:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="bench", max_retries=0, timeout=300)
    seed = next(
        s
        for s in range(50)
        if client.completions.create(model=NAME, prompt="Hello", max_tokens=new_tokens, seed=s)
        .choices[0]
        .finish_reason
        == "length"
    )  # an answer that runs to max_tokens
    shares, firsts, totals = [], [], []
    for _ in range(rounds + 1):  # the first one warms up
        t0 = time.perf_counter()
        times = []
        for _chunk in client.completions.create(
            model=NAME, prompt="Hello", max_tokens=new_tokens, seed=seed, stream=True
        ):
            times.append(time.perf_counter() - t0)
        firsts.append(times[0])
        totals.append(times[-1])
        shares.append(times[0] / times[-1])
    out = {
        "first_chunk_ms": 1000 * statistics.median(firsts[1:]),
        "stream_total_ms": 1000 * statistics.median(totals[1:]),
        "first_chunk_share": statistics.median(shares[1:]),
    }
    print(
        f"stream of {new_tokens} tokens: first chunk after {out['first_chunk_ms']:.0f} ms of "
        f"{out['stream_total_ms']:.0f} ms (share {out['first_chunk_share']:.3f})"
    )
    return out


# ---- 3. continuous batching -----------------------------------------------------------------


class _WholeBatches:
    """The engine without its incremental sampler: each engine.sample call runs to the end,
    as the loop ran before continuous batching."""

    def __init__(self, engine: Engine):
        self._engine = engine

    def __getattr__(self, name: str):
        if name == "decode_batch":
            raise AttributeError(name)
        return getattr(self._engine, name)


def _requests(engine: Engine, n: int, new_tokens: int) -> list[SampleRequest]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        length = int(torch.randint(16, 49, (1,), generator=g))
        prompt = torch.randint(0, engine.vocab_size, (length,), generator=g).tolist()
        spec = SampleSpec(max_tokens=new_tokens, seed=i, stop_at_eos=False)
        out.append(SampleRequest(prompt, 1, spec))
    return out


def _arrivals(engine: object, facts: EngineFacts, reqs: list, gap_s: float) -> float:
    """Seconds from the first arrival to the last result, requests arriving gap_s apart."""
    done = threading.Event()
    got: list[Outcome] = []

    def heard(outcomes: list[Outcome]) -> None:
        got.extend(outcomes)
        if len(got) == len(reqs):
            done.set()

    loop = EngineLoop(facts, OpExecutor(engine, writer=None), heard, max_sample_batch=64)
    loop.start()
    try:
        t0 = time.perf_counter()
        for i, r in enumerate(reqs):
            loop.submit(Op(f"s{i}", OpKind.SAMPLE, Sample(r)))
            time.sleep(max(0.0, t0 + (i + 1) * gap_s - time.perf_counter()))
        assert done.wait(600)
        assert all(o.succeeded for o in got)
        return time.perf_counter() - t0
    finally:
        loop.stop()


def arrivals(engine: Engine, n: int, new_tokens: int, rounds: int) -> dict:
    reqs = _requests(engine, n, new_tokens)
    facts = EngineFacts.of(NAME, engine)
    engine.sample(reqs)  # warm-up
    by_hand, stream, whole = [], [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        engine.sample(reqs)
        by_hand.append(time.perf_counter() - t0)
        gap = by_hand[-1] / 4 / n  # every request in by a quarter of the by-hand time
        stream.append(_arrivals(engine, facts, reqs, gap))
        whole.append(_arrivals(_WholeBatches(engine), facts, reqs, gap))
    tokens = n * new_tokens
    t_hand, t_stream, t_whole = map(statistics.median, (by_hand, stream, whole))
    out = {
        "by_hand_tokens_per_s": tokens / t_hand,
        "arrivals_tokens_per_s": tokens / t_stream,
        "arrivals_vs_by_hand": t_hand / t_stream,
        "arrivals_whole_batches_vs_by_hand": t_hand / t_whole,
    }
    print(
        f"{n} requests x {new_tokens} tokens arriving over a quarter of the by-hand time: "
        f"{out['arrivals_tokens_per_s']:.0f} tokens/s vs {out['by_hand_tokens_per_s']:.0f} "
        f"batched by hand (x{out['arrivals_vs_by_hand']:.2f}; whole batches one after "
        f"another: x{out['arrivals_whole_batches_vs_by_hand']:.2f})"
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller generations, fewer rounds")
    parser.add_argument("--size", default="tiny", choices=["tiny", "small"], help="tiny model size")
    args = parser.parse_args()
    rows, new_tokens, rounds = (16, 256, 5) if args.quick else (32, 512, 10)
    torch.set_num_threads(1)
    result: dict = {"size": args.size, "rows": rows, "new_tokens": new_tokens}
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "model", arch="llama", size=args.size)
        with ServerProcess({NAME: model}, Path(tmp) / "data") as server:
            result |= fb_latency(server.url, rows, new_tokens, rounds)
            result |= first_chunk(server.url, 64, rounds)
        engine = Engine(model)
        result |= arrivals(engine, 32, 64, 3 if args.quick else 5)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
