"""What a call costs on PostgreSQL: one server on SQLite, one on PostgreSQL, and two API
processes on PostgreSQL (the engine host and a frontend), with calls sent to the frontend
only and alternating between the two.

    .venv/bin/python bench/postgres.py               # 30 calls of each kind per setting
    .venv/bin/python bench/postgres.py --calls 10

Each setting runs the same minimal calls through the treadle SDK, each submitted and then
waited for: an optim_step (the engine's own time is a few ms) and a forward of one token.
The PostgreSQL server is started here (initdb and pg_ctl, as tests/postgres does). Figures
are medians, with their ratio to the SQLite server measured in the same run. Ends with one
JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "postgres"))

from _pg import PostgresServer  # noqa: E402
from _roundrobin import RoundRobin  # noqa: E402

from treadle import AdamParams, Datum, ModelInput, ServiceClient  # noqa: E402
from treadle.engine.tiny import make_tiny_model  # noqa: E402
from treadle.launch import ServerProcess  # noqa: E402

NAME = "bench/tiny-llama"


def calls(url: str, n: int) -> dict[str, float]:
    """Median ms of a submitted-then-awaited optim_step and one-token forward."""
    one = Datum(
        model_input=ModelInput.from_ints([1]),
        loss_fn_inputs={"target_tokens": [2], "weights": np.ones(1, np.float32)},
    )
    with ServiceClient(base_url=url) as svc:
        tc = svc.create_lora_training_client(NAME, rank=4)
        tc.forward([one]).result()  # warm-up
        times: dict[str, list[float]] = {"optim": [], "forward1": []}
        for _ in range(n):
            t0 = time.perf_counter()
            tc.optim_step(AdamParams(learning_rate=1e-4)).result()
            t1 = time.perf_counter()
            tc.forward([one]).result()
            t2 = time.perf_counter()
            times["optim"].append(t1 - t0)
            times["forward1"].append(t2 - t1)
        return {k: 1000 * statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=30)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="treadle-bench-pg-"))
    model = make_tiny_model(root / "model", arch="llama")
    out: dict[str, dict[str, float]] = {}
    with PostgresServer() as pg:
        lone = ServerProcess({NAME: model}, root / "sqlite", startup_timeout_s=240).start()
        try:
            out["sqlite"] = calls(lone.url, args.calls)
        finally:
            lone.stop()
        url = pg.create_database("bench")
        config = {"db_url": url}
        host = ServerProcess({NAME: model}, root / "pg", config=config, log_path=root / "host.log")
        host.startup_timeout_s = 240
        host.start()
        try:
            out["postgresql"] = calls(host.url, args.calls)
            front = ServerProcess(
                {NAME: model},
                root / "pg",
                config={**config, "engine_host": False},
                log_path=root / "front.log",
                startup_timeout_s=240,
            ).start()
            try:
                out["frontend"] = calls(front.url, args.calls)
                with RoundRobin([front.port, host.port]) as lb:
                    out["alternating"] = calls(lb.url, args.calls)
            finally:
                front.stop()
        finally:
            host.stop()
    base = out["sqlite"]
    print(f"median ms of {args.calls} calls, each submitted then awaited (ratio to SQLite):")
    for setting, figures in out.items():
        cells = "   ".join(f"{k} {v:7.2f} ({v / base[k]:.2f}x)" for k, v in sorted(figures.items()))
        print(f"  {setting:12s} {cells}")
    flat = {f"{s}_{k}_ms": round(v, 2) for s, f in out.items() for k, v in f.items()}
    print(json.dumps({"bench": "postgres", "calls": args.calls, **flat}))


if __name__ == "__main__":
    main()
