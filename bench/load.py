"""Many tenants at once: N client processes against one `treadle serve` for D seconds, each
looping over the mixed work of a live training session.

    .venv/bin/python bench/load.py                           # 16 clients x 60 s, its own server
    .venv/bin/python bench/load.py --clients 4 --seconds 20 --stream
    .venv/bin/python bench/load.py --url http://host:8000 --api-key tml-...   # a running server

Each client (a process of its own, as users' loops are) creates a training session and a
base-model sampling client, then loops until the deadline:

    forward_backward (4 x 64 tokens) -> optim_step -> sample (2 x 16 tokens, base model)
    -> POST /v1/chat/completions with model = its training client's model_id (16 tokens)

(`--stream`: the chat is streamed, and an `error` event in the stream counts as a failure).
Every op is timed at the client. A poller asks /api/v1/healthz twice a second. With its own
server the bench also reads the resident memory of the server and its workers a third of the
way in and at the end.

Reports failures by kind (op and the first words of the error), p50/p99 latency per op, healthz
latency, and memory growth; ends with one JSON line. `failures` must be 0.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import re
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np

CHAT_PROMPT = [{"role": "user", "content": "Count from one to ten."}]


def client_loop(
    url: str, api_key: str, model: str, seconds: float, stream: bool, seed: int, start=None
):
    """One client's loop; → {"lat": {op: [s]}, "failures": [(op, message)]}. `start`: a
    barrier every client waits at once its session is made, so that the loops overlap."""
    from treadle import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient

    rng = np.random.default_rng(seed)
    lat: dict[str, list[float]] = {}
    failures: list[tuple[str, str]] = []
    svc = ServiceClient(base_url=url, api_key=api_key)
    tc = svc.create_lora_training_client(model, rank=8)
    base = svc.create_sampling_client(base_model=model)
    vocab = tc.get_tokenizer().vocab_size
    http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {api_key}"}, timeout=120)

    def timed(op: str, fn) -> None:
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - every failure is counted, by kind
            failures.append((op, f"{type(e).__name__}: {e}"[:160]))
        else:
            lat.setdefault(op, []).append(time.perf_counter() - t0)

    def datums() -> list[Datum]:
        rows = rng.integers(0, vocab, (4, 65))  # (B, T+1)
        return [
            Datum(
                model_input=ModelInput.from_ints(r[:-1].tolist()),
                loss_fn_inputs={"target_tokens": r[1:], "weights": np.ones(64, np.float32)},
            )
            for r in rows
        ]

    def chat() -> None:
        body = {"model": tc.model_id, "messages": CHAT_PROMPT, "max_tokens": 16, "seed": seed}
        if not stream:
            r = http.post("/v1/chat/completions", json=body)
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {r.text}")
            return
        with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode()}")
            last = ""
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                last = line[6:]
                if last.startswith('{"error"'):
                    raise RuntimeError(f"stream error event: {last}")
            if last != "[DONE]":
                raise RuntimeError(f"stream ended without [DONE]: {last!r}")

    prompt = ModelInput.from_ints(rng.integers(0, vocab, 8).tolist())
    params = SamplingParams(max_tokens=16, temperature=1.0)
    if start is not None:
        start.wait()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        timed("forward_backward", lambda: tc.forward_backward(datums(), "cross_entropy").result())
        timed("optim_step", lambda: tc.optim_step(AdamParams(learning_rate=1e-4)).result())
        timed("sample", lambda: base.sample(prompt, num_samples=2, sampling_params=params).result())
        timed("chat", chat)
    http.close()
    svc.close()
    return {"lat": lat, "failures": failures}


def _client(args: tuple, start, results) -> None:
    try:
        results.put(client_loop(*args, start=start))
    except BaseException as e:  # noqa: BLE001 - a client that could not start is a failure too
        start.abort()
        results.put({"lat": {}, "failures": [("setup", f"{type(e).__name__}: {e}")]})


def resident_mb(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


class Poller(threading.Thread):
    """healthz round trips twice a second; memory of the server's processes at given times."""

    def __init__(self, url: str, server, mem_at: list[float]):
        super().__init__(daemon=True)
        self.url, self.server, self.mem_at = url, server, sorted(mem_at)
        self.healthz: list[float] = []
        self.memory: list[float] = []
        self.stop = threading.Event()

    def run(self) -> None:
        t0 = time.monotonic()
        with httpx.Client(timeout=30) as http:
            while not self.stop.wait(0.5):
                s = time.perf_counter()
                http.get(f"{self.url}/api/v1/healthz")
                self.healthz.append(time.perf_counter() - s)
                if (
                    self.server is not None
                    and self.mem_at
                    and time.monotonic() - t0 >= self.mem_at[0]
                ):
                    self.mem_at.pop(0)
                    self.memory.append(resident_mb([self.server.proc.pid, *self.server.children()]))


def kind_of(message: str) -> str:
    """An error message without its ids and numbers, so that failures of one cause add up."""
    return re.sub(r"[0-9a-f]{8,}|\d+", "#", message)[:100]


def pct(xs: list[float], q: float) -> float:
    return 1000 * float(np.percentile(xs, q)) if xs else float("nan")


def run(
    url: str, api_key: str, model: str, clients: int, seconds: float, stream: bool, server=None
) -> dict:
    ctx = mp.get_context("spawn")
    start, queue = ctx.Barrier(clients + 1), ctx.Queue()
    procs = [
        ctx.Process(target=_client, args=((url, api_key, model, seconds, stream, i), start, queue))
        for i in range(clients)
    ]
    for p in procs:
        p.start()
    try:
        start.wait()  # every client has its session: the loops start together
    except threading.BrokenBarrierError:
        pass
    poller = Poller(url, server, [seconds / 3, seconds])
    poller.start()
    results = [queue.get() for _ in procs]
    for p in procs:
        p.join()
    poller.stop.set()
    poller.join()
    lat: dict[str, list[float]] = {}
    failures: Counter[str] = Counter()
    for r in results:
        for op, xs in r["lat"].items():
            lat.setdefault(op, []).extend(xs)
        for op, message in r["failures"]:
            failures[f"{op}: {kind_of(message)}"] += 1
    ops = {
        op: {"n": len(xs), "p50_ms": pct(xs, 50), "p99_ms": pct(xs, 99)} for op, xs in lat.items()
    }
    growth = poller.memory[-1] - poller.memory[0] if len(poller.memory) >= 2 else None
    return {
        "clients": clients,
        "seconds": seconds,
        "stream": stream,
        "ops": ops,
        "ok": sum(len(xs) for xs in lat.values()),
        "failures": sum(failures.values()),
        "failures_by_kind": dict(failures.most_common()),
        "healthz_p50_ms": pct(poller.healthz, 50),
        "healthz_max_ms": 1000 * max(poller.healthz, default=float("nan")),
        "memory_mb": poller.memory,
        "memory_growth_mb": growth,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--stream", action="store_true", help="stream the chat completions")
    ap.add_argument("--url", help="a running server (default: start one on a tiny model)")
    ap.add_argument("--api-key", default="tml-bench")
    ap.add_argument("--model", default="treadle/tiny-llama", help="the base model to train")
    args = ap.parse_args()
    if args.url:
        out = run(args.url, args.api_key, args.model, args.clients, args.seconds, args.stream)
    else:
        from treadle.engine.tiny import make_tiny_model
        from treadle.launch import ServerProcess

        with tempfile.TemporaryDirectory() as tmp:
            model_dir = make_tiny_model(Path(tmp) / "tiny-llama", arch="llama")
            with ServerProcess({args.model: model_dir}, Path(tmp) / "data") as server:
                out = run(
                    server.url, args.api_key, args.model, args.clients, args.seconds,
                    args.stream, server,
                )  # fmt: skip
    for op, s in out["ops"].items():
        print(f"{op:17s} n={s['n']:5d}  p50 {s['p50_ms']:8.1f} ms  p99 {s['p99_ms']:8.1f} ms")
    print(f"healthz p50 {out['healthz_p50_ms']:.1f} ms, max {out['healthz_max_ms']:.1f} ms")
    print(f"memory {out['memory_mb']} MB (growth {out['memory_growth_mb']})")
    print(f"failures {out['failures']}: {out['failures_by_kind']}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
