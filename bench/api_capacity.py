"""How many calls one API process can carry: a minimal call (optim_step: file it, long-poll its
result) from many concurrent clients against `treadle serve`'s app with an engine that does
no work, so that the API process (HTTP, auth, checks, the journal's commits, the worker
protocol) is all that is measured.

    .venv/bin/python bench/api_capacity.py                      # 32 clients x 20 s
    .venv/bin/python bench/api_capacity.py --clients 64 --seconds 30

The server runs in a process of its own (uvicorn, the real app, its worker on a thread with
the real engine loop and protocol over an in-process socket, and a real SQLite database with
durable request rows); only the Engine is a stand-in that returns at once. Clients are
asyncio tasks in this process (aiohttp), each with its own training session. Reported: calls/s
(a call = its submit and its result), the latency of a call (p50 / p99), and the API process's
CPU time per call (read from /proc), from which the number of accelerators one API process
can feed follows for a given call rate per accelerator. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

NAME = "bench/fake"
ADAM = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12}


class FakeEngine:
    """An engine that does no work: what the worker's executor calls, answered at once."""

    arch = "llama"
    device = "cpu"

    def __init__(self, vocab_size: int, max_seq_len: int):
        self.vocab_size, self.max_seq_len, self.max_lora_rank = vocab_size, max_seq_len, 64
        self.steps: dict[str, int] = {}

    def create_adapter(self, adapter_id, spec) -> None:
        self.steps[adapter_id] = 0

    def drop_adapter(self, adapter_id) -> None:
        self.steps.pop(adapter_id, None)

    def optim_step(self, adapter_id, spec) -> dict[str, float]:
        self.steps[adapter_id] += 1
        return {"grad_norm": 0.0}

    def adapter_step(self, adapter_id) -> int:
        return self.steps[adapter_id]

    def save_snapshot(self, adapter_id, out_dir) -> None:
        Path(out_dir, "step").write_text(str(self.steps[adapter_id]))


def serve(port: int, data_dir: str, model_dir: str) -> None:
    """The server process: the real app, its worker on a thread around a FakeEngine."""
    import uvicorn

    from treadle.server.app import create_app
    from treadle.server.config import ServerConfig
    from treadle.server.main import configure_process

    config = ServerConfig(
        models={NAME: model_dir}, data_dir=data_dir, port=port, engine_processes=False
    )
    configure_process(config)
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model_dir)

    def fake(name: str, path: str, cfg: ServerConfig) -> FakeEngine:
        return FakeEngine(hf.vocab_size, hf.max_position_embeddings)

    app = create_app(config, engine_factory=fake)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


async def client(url: str, deadline: float, lat: list[float]) -> None:
    import aiohttp

    async with aiohttp.ClientSession(base_url=url) as http:

        async def call(path: str, body: dict) -> dict:
            async with http.post(f"/api/v1/{path}", json=body) as r:
                r.raise_for_status()
                return await r.json()

        async def result(rid: str) -> dict:
            while True:
                reply = await call("retrieve_future", {"request_id": rid})
                if reply.get("type") != "try_again":
                    return reply

        sid = (await call("create_session", {"tags": []}))["session_id"]
        model = await call(
            "create_model", {"session_id": sid, "model_seq_id": 0, "base_model": NAME}
        )
        await result(model["request_id"])
        seq = 1
        while time.monotonic() < deadline:
            t0 = time.perf_counter()
            body = {"model_id": model["model_id"], "seq_id": seq, "adam_params": ADAM}
            reply = await result((await call("optim_step", body))["request_id"])
            assert "metrics" in reply, reply
            lat.append(time.perf_counter() - t0)
            seq += 1


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


async def load(url: str, clients: int, seconds: float, pid: int) -> dict:
    warm: list[float] = []
    await asyncio.gather(*(client(url, time.monotonic() + 2, warm) for _ in range(clients)))
    lat: list[float] = []
    cpu0, t0 = cpu_seconds(pid), time.monotonic()
    await asyncio.gather(*(client(url, t0 + seconds, lat) for _ in range(clients)))
    wall, cpu = time.monotonic() - t0, cpu_seconds(pid) - cpu0
    return {
        "clients": clients,
        "calls": len(lat),
        "calls_per_s": len(lat) / wall,
        "p50_ms": 1000 * float(np.percentile(lat, 50)),
        "p99_ms": 1000 * float(np.percentile(lat, 99)),
        "api_cpu_ms_per_call": 1000 * cpu / max(1, len(lat)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--serve", nargs=3, metavar=("PORT", "DATA", "MODEL"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(int(args.serve[0]), args.serve[1], args.serve[2])
        return
    from treadle.engine.tiny import make_tiny_model
    from treadle.launch import free_port

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / "tiny", arch="llama")
        port = free_port()
        cmd = [sys.executable, __file__, "--serve", str(port), f"{tmp}/data", str(model_dir)]
        server = subprocess.Popen(cmd)
        try:
            import httpx

            while True:
                try:
                    httpx.get(f"http://127.0.0.1:{port}/api/v1/healthz", timeout=1)
                    break
                except httpx.TransportError:
                    if server.poll() is not None:
                        raise SystemExit("the server did not start") from None
                    time.sleep(0.2)
            out = asyncio.run(
                load(f"http://127.0.0.1:{port}", args.clients, args.seconds, server.pid)
            )
        finally:
            server.terminate()
            server.wait(60)
    print(
        f"{out['calls_per_s']:.0f} calls/s with {out['clients']} clients "
        f"(p50 {out['p50_ms']:.1f} ms, p99 {out['p99_ms']:.1f} ms), "
        f"{out['api_cpu_ms_per_call']:.2f} ms of API-process CPU per call"
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
