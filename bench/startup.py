"""What one `treadle serve` costs to start: the API process and its engine worker, each in CPU
seconds until the server is healthy, and the API process's memory.

    .venv/bin/python bench/startup.py --starts 3

Each start is a real `treadle serve` of the tiny model on a fresh data folder, stopped once
healthy; CPU is read from /proc for each process (user + system). The API process never
imports torch (the worker loads the model and checks its architecture and tokenizer), so its
start costs a fraction of its worker's: the ratio is the figure to compare across machines.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from treadle.engine.tiny import make_tiny_model
from treadle.launch import ServerProcess

TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def one_start(model: Path, data: Path) -> dict:
    started = time.perf_counter()
    with ServerProcess({"treadle/tiny-llama": model}, data) as server:
        healthy_s = time.perf_counter() - started
        api = server.proc.pid
        workers = list(server.children())
        figures = {
            "healthy_s": healthy_s,
            "api_cpu_s": cpu_s(api),
            "api_rss_mb": rss_mb(api),
            "worker_cpu_s": sum(cpu_s(w) for w in workers),
            "api_has_torch": "libtorch" in Path(f"/proc/{api}/maps").read_text(),
        }
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--starts", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "tiny-llama", arch="llama")
        runs = [one_start(model, Path(tmp) / f"data-{i}") for i in range(args.starts)]
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "api_has_torch"}
    med["api_over_worker_cpu"] = med["api_cpu_s"] / med["worker_cpu_s"]
    med["api_has_torch"] = any(r["api_has_torch"] for r in runs)
    for key, value in med.items():
        print(f"{key:22s} {value:.2f}" if isinstance(value, float) else f"{key:22s} {value}")
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in med.items()}))


if __name__ == "__main__":
    main()
