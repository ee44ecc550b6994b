"""A session's request timeline: each op's queue wait and run time, percentiles per kind,
lanes for drawing, and the Chrome / Perfetto trace export.

An op is a dict of op_records columns (treadle.server.storage.rows.OpRecordRow): wall-clock
seconds `queued_at` (filed), `started_at` (its engine call began; None if it never ran)
and `finished_at`. Wait = started - queued, run = finished - started.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

PERCENTILES = (50, 90, 99)


def wait_s(op: dict[str, Any]) -> float:
    started = op["started_at"] if op["started_at"] is not None else op["finished_at"]
    return max(0.0, started - op["queued_at"])


def run_s(op: dict[str, Any]) -> float:
    if op["started_at"] is None:
        return 0.0
    return max(0.0, op["finished_at"] - op["started_at"])


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of ascending values (0 for none)."""
    if not sorted_values:
        return 0.0
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return float(sorted_values[rank - 1])


def summarize(ops: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per kind: count, failures, and p50/p90/p99 of wait and run in milliseconds."""
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for op in ops:
        by_kind.setdefault(op["kind"], []).append(op)
    out = {}
    for kind, group in sorted(by_kind.items()):
        waits = sorted(wait_s(op) * 1e3 for op in group)
        runs = sorted(run_s(op) * 1e3 for op in group if op["started_at"] is not None)
        out[kind] = {
            "count": len(group),
            "failed": sum(1 for op in group if op["status"] != "done"),
            "wait_ms": {f"p{q}": round(percentile(waits, q), 3) for q in PERCENTILES},
            "run_ms": {f"p{q}": round(percentile(runs, q), 3) for q in PERCENTILES},
        }
    return out


def lane_group(op: dict[str, Any]) -> str:
    """Training ops of a model share lanes; samples and the rest have their own."""
    if op["kind"] == "sample":
        return "sample"
    return f"train {model_label(op.get('model_id'))}"


def model_label(model_id: str | None) -> str:
    # "<session_id>:train:<n>" → "model n"
    if not model_id:
        return "-"
    return f"model {model_id.rsplit(':', 1)[-1]}"


def assign_lanes(ops: Sequence[dict[str, Any]]) -> list[tuple[str, int]]:
    """(group, lane) per op such that no two ops of a lane overlap in [queued, finished]:
    greedy interval partitioning in order of filing, the fewest lanes per group."""
    order = sorted(range(len(ops)), key=lambda i: (ops[i]["queued_at"], ops[i]["finished_at"]))
    ends: dict[str, list[float]] = {}
    out: list[tuple[str, int]] = [("", 0)] * len(ops)
    for i in order:
        op = ops[i]
        group = lane_group(op)
        lanes = ends.setdefault(group, [])
        lane = next((n for n, end in enumerate(lanes) if end <= op["queued_at"]), None)
        if lane is None:
            lane = len(lanes)
            lanes.append(0.0)
        lanes[lane] = op["finished_at"]
        out[i] = (group, lane)
    return out


def chrome_trace(ops: Sequence[dict[str, Any]], title: str) -> dict[str, Any]:
    """The ops as Chrome trace events (chrome://tracing, ui.perfetto.dev): one complete
    event per op from filing to result, holding a nested "engine call" event for its run."""
    lanes = assign_lanes(ops)
    tids: dict[tuple[str, int], int] = {}
    for key in sorted(set(lanes)):
        tids[key] = len(tids) + 1
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": title}}
    ]
    for (group, lane), tid in tids.items():
        events.append(
            {
                "ph": "M",
                "name": "thread_name",
                "pid": 1,
                "tid": tid,
                "args": {"name": f"{group} #{lane + 1}"},
            }
        )
        events.append(
            {
                "ph": "M",
                "name": "thread_sort_index",
                "pid": 1,
                "tid": tid,
                "args": {"sort_index": tid},
            }
        )
    for op, key in zip(ops, lanes, strict=True):
        tid = tids[key]
        start_us = op["queued_at"] * 1e6
        args = {
            "request_id": op["request_id"],
            "model_id": op.get("model_id"),
            "status": op["status"],
            "step": op.get("step"),
            "wait_ms": round(wait_s(op) * 1e3, 3),
            "run_ms": round(run_s(op) * 1e3, 3),
            "batch_ops": op.get("batch_ops"),
            "tokens": _tokens(op),
        }
        if op.get("error"):
            args["error"] = op["error"]
        events.append(
            {
                "ph": "X",
                "cat": "op",
                "name": op["kind"],
                "pid": 1,
                "tid": tid,
                "ts": round(start_us, 1),
                "dur": round((op["finished_at"] - op["queued_at"]) * 1e6, 1),
                "args": args,
            }
        )
        if op["started_at"] is not None:
            events.append(
                {
                    "ph": "X",
                    "cat": "run",
                    "name": "engine call",
                    "pid": 1,
                    "tid": tid,
                    "ts": round(op["started_at"] * 1e6, 1),
                    "dur": round(run_s(op) * 1e6, 1),
                    "args": {"batch_ops": op.get("batch_ops")},
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"title": title}}


def svg_bars(
    ops: Sequence[dict[str, Any]], width: float = 1000.0, max_height: float = 480.0
) -> dict:
    """Bars for the page's timeline drawing: per op its lane row and x positions of
    filing, start and end scaled to `width`, with the group labels of the rows. Rows are
    12 px high, thinner when there are many (many samples in flight), down to 3 px."""
    if not ops:
        return {"bars": [], "rows": [], "height": 0, "span_s": 0.0, "width": width}
    lanes = assign_lanes(ops)
    keys = sorted(set(lanes))
    lane_px = max(3.0, min(12.0, max_height / len(keys)))
    row_of = {k: i for i, k in enumerate(keys)}
    t0 = min(op["queued_at"] for op in ops)
    t1 = max(op["finished_at"] for op in ops)
    span = max(t1 - t0, 1e-6)
    x = lambda t: round((t - t0) / span * width, 2)  # noqa: E731
    bars = []
    for op, key in zip(ops, lanes, strict=True):
        started = op["started_at"] if op["started_at"] is not None else op["finished_at"]
        bars.append(
            {
                "y": round(row_of[key] * lane_px, 2),
                "x0": x(op["queued_at"]),
                "x1": x(started),
                "x2": max(x(op["finished_at"]), x(started) + 0.5),
                "kind": op["kind"],
                "failed": op["status"] != "done",
                "title": f"{op['kind']} {op['request_id']}: wait {wait_s(op) * 1e3:.1f} ms, "
                f"run {run_s(op) * 1e3:.1f} ms",
            }
        )
    rows = [
        {"y": round(i * lane_px, 2), "label": f"{g} #{n + 1}"}
        for i, (g, n) in enumerate(keys)
        if n == 0
    ]
    return {
        "bars": bars,
        "rows": rows,
        "height": round(len(keys) * lane_px, 2),
        "span_s": span,
        "width": width,
        "lane_px": lane_px,
    }


def _tokens(op: dict[str, Any]) -> int:
    return (
        int(op.get("prompt_tokens") or 0)
        + int(op.get("sampled_tokens") or 0)
        + int(op.get("train_tokens") or 0)
    )
