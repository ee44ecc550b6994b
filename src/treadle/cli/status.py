"""`treadle status`: each served model's worker groups, as a running server sees them.

treadle status --base-url http://127.0.0.1:8000
treadle status --json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import httpx

from treadle.cli.checkpoints import _table


def add_parser(sub: Any) -> None:
    p = sub.add_parser("status", help="health and placement of the served models' workers")
    p.add_argument(
        "--base-url", default=os.environ.get("TREADLE_BASE_URL", "http://127.0.0.1:8000")
    )
    p.add_argument("--api-key", default=os.environ.get("TREADLE_API_KEY"))
    p.add_argument("--json", action="store_true", help="the server's answer as it is")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    headers = {"X-API-Key": args.api_key} if args.api_key else {}
    try:
        resp = httpx.get(f"{args.base_url.rstrip('/')}/api/v1/treadle/status", headers=headers)
    except httpx.TransportError as e:
        sys.exit(
            f"treadle status: cannot reach {args.base_url} ({e}); is `treadle serve` running "
            "there? pass its address with --base-url (or set TREADLE_BASE_URL)"
        )
    if resp.status_code != 200:
        sys.exit(f"treadle status: HTTP {resp.status_code}: {resp.text}")
    status = resp.json()
    if args.json:
        print(json.dumps(status, indent=2))
        return
    rows = [
        [
            m["model"],
            str(r["replica"]),
            r["status"],
            str(r.get("worker_pid") or "-"),
            str(r.get("device") or "-"),
            str(r.get("sessions", 0)),
            str(r.get("queue_depth", 0)),
            f"{r['memory_mb']:.0f} MB" if r.get("memory_mb") else "-",
        ]
        for m in status["models"]
        for r in m["replicas"]
    ]
    header = ["model", "replica", "status", "pid", "device", "sessions", "queue", "memory"]
    print(_table(rows, header))
    for m in status["models"]:
        for r in m["replicas"]:
            if r.get("reason"):
                print(f"{m['model']} (replica {r['replica']}) is down: {r['reason']}")
