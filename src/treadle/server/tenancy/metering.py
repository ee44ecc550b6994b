"""Metering: the three token counters of every operation, and the usage reports built on them.

Counted where operations run (treadle.worker.executor), so every path that samples or
trains through the Service is metered, whatever route it came by:
- prefill: the prompt tokens of a sample request (sample, compute_logprobs), once per
  request: its num_samples completions share one pass over the prompt;
- sample: the tokens generated, summed over the request's completions (compute_logprobs is
  a sample of max_tokens 1, so it generates, and counts, one token);
- train: the model-input tokens of a forward or forward_backward request;
- cached_prefill: the prompt tokens of a sample request that the sampler's prefix cache
  held (treadle.engine.prefix_cache), priced apart (Price.cached_prefill, by default a
  fraction of prefill) and not counted in prefill.
Only operations that succeed are counted; time spent between calls costs nothing.

The counts are written with the result (the requests table) and the result of every
metered operation (forward, forward_backward, sample) carries its own: as JSON a "usage"
key, as protobuf (ForwardBackwardOutput, SampleResponse) a field (number USAGE_FIELD) that
the tinker schema does not have, which protobuf parsers skip.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

from sqlalchemy import Engine, func, select

from treadle.errors import InvalidRequestError
from treadle.server.config import Price
from treadle.server.storage.rows import DEFAULT_TENANT_ID, RequestRow, SessionRow, TenantRow

USAGE_FIELD = 1001
# The operations that process tokens; their results carry their usage.
METERED_KINDS = ("forward", "forward_backward", "sample")
COUNTERS = ("prefill_tokens", "sample_tokens", "train_tokens", "cached_prefill_tokens")
# RequestRow columns of each counter
COLUMN_OF = {
    "prefill_tokens": "prompt_tokens",
    "sample_tokens": "sampled_tokens",
    "train_tokens": "train_tokens",
    "cached_prefill_tokens": "cached_prompt_tokens",
}
GROUPINGS = ("session", "day", "model")


def usage_of(outcome: Any) -> dict[str, int]:
    """The counters of an outcome dict or a request row mapping."""
    return {c: int(outcome.get(COLUMN_OF[c]) or 0) for c in COUNTERS}


# ---- usage inside results ----
def with_usage(body: bytes, content_type: str, usage: dict[str, int]) -> bytes:
    """A result body that also carries its usage."""
    if "protobuf" in content_type:
        return body + _usage_field(usage)
    try:
        reply = json.loads(body)
    except ValueError:
        return body
    if not isinstance(reply, dict):
        return body
    reply["usage"] = usage
    return json.dumps(reply).encode()


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _usage_field(usage: dict[str, int]) -> bytes:
    # a message {1: prefill, 2: sample, 3: train, 4: cached prefill} as field USAGE_FIELD
    inner = b"".join(
        _varint(i << 3) + _varint(usage.get(c, 0)) for i, c in enumerate(COUNTERS, start=1)
    )
    return _varint(USAGE_FIELD << 3 | 2) + _varint(len(inner)) + inner


def _read_varint(buf: bytes, i: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        byte = buf[i]
        i += 1
        n |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return n, i


def proto_usage(body: bytes) -> dict[str, int] | None:
    """The usage field of a protobuf result body, if it has one."""
    i, found = 0, None
    while i < len(body):
        key, i = _read_varint(body, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            _, i = _read_varint(body, i)
        elif wire == 1:
            i += 8
        elif wire == 5:
            i += 4
        elif wire == 2:
            size, i = _read_varint(body, i)
            if number == USAGE_FIELD:
                found = _usage_message(body[i : i + size])
            i += size
        else:
            raise ValueError(f"protobuf body: unsupported wire type {wire}")
    return found


def _usage_message(buf: bytes) -> dict[str, int]:
    usage = dict.fromkeys(COUNTERS, 0)
    i = 0
    while i < len(buf):
        key, i = _read_varint(buf, i)
        value, i = _read_varint(buf, i)
        if 1 <= key >> 3 <= len(COUNTERS):
            usage[COUNTERS[(key >> 3) - 1]] = value
    return usage


# ---- reports ----
def cost_usd(usage: dict[str, int], price: Price | None) -> float:
    if price is None:
        return 0.0
    per_million = (
        usage["prefill_tokens"] * price.prefill
        + usage["sample_tokens"] * price.sample
        + usage["train_tokens"] * price.train
        + usage.get("cached_prefill_tokens", 0) * price.cached_prefill_rate
    )
    return per_million / 1e6


def parse_since(since: str | None) -> dt.datetime | None:
    """`YYYY-MM-DD` or an ISO time (UTC unless it says otherwise)."""
    if not since:
        return None
    try:
        when = dt.datetime.fromisoformat(since)
    except ValueError as e:
        raise ValueError(
            f"since: expected a date (YYYY-MM-DD) or an ISO time, got {since!r}"
        ) from e
    return when if when.tzinfo else when.replace(tzinfo=dt.UTC)


def usage_query(since: str | None, by: str | None) -> dt.datetime | None:
    """The `since` and `by` of a usage request, checked: → the time it starts from.
    InvalidRequestError naming the field (the API, the console's pages and its JSON)."""
    try:
        when = parse_since(since)
        if by is not None and by not in GROUPINGS:
            raise ValueError(f"by: expected one of {list(GROUPINGS)}, got {by!r}")
    except ValueError as e:
        raise InvalidRequestError(str(e)) from e
    return when


def metered(r: Any) -> Any:
    """The requests usage counts: the finished ones, and the failed ones that ran part of
    the way first (a generation cancelled after it sampled some tokens)."""
    ran = r.c.prompt_tokens + r.c.sampled_tokens + r.c.train_tokens + r.c.cached_prompt_tokens
    return (r.c.status == "done") | ((r.c.status == "failed") & (ran > 0))


def usage_report(
    engine: Engine,
    prices: dict[str, Price],
    tenant_id: str | None = None,
    since: dt.datetime | None = None,
    by: str | None = None,
) -> dict[str, Any]:
    """Totals (and rows grouped `by` session, day or model) of the finished requests of one
    tenant (or all), with their cost from the price table."""
    if by is not None and by not in GROUPINGS:
        raise ValueError(f"by: expected one of {list(GROUPINGS)}, got {by!r}")
    r = RequestRow.__table__
    key = {
        "session": r.c.session_id,
        "day": func.date(r.c.finished_at),
        "model": r.c.base_model,
        None: r.c.tenant_id,  # no grouping: one row per tenant
    }[by]
    sums = [func.coalesce(func.sum(r.c[COLUMN_OF[c]]), 0) for c in COUNTERS]
    stmt = (
        select(r.c.tenant_id, key.label("key"), r.c.base_model, func.count(), *sums)
        .where(metered(r))
        .group_by(r.c.tenant_id, key, r.c.base_model)
    )
    if tenant_id is not None:
        stmt = stmt.where(r.c.tenant_id == tenant_id)
    if since is not None:
        stmt = stmt.where(r.c.finished_at >= since)
    with engine.connect() as conn:
        found = conn.execute(stmt).all()
        names = dict(conn.execute(select(TenantRow.tenant_id, TenantRow.name)).all())
        # by session: each row also names its session (its display_name)
        session_names = (
            dict(
                conn.execute(
                    select(SessionRow.session_id, SessionRow.display_name).where(
                        SessionRow.session_id.in_({group for _, group, *_ in found})
                    )
                ).all()
            )
            if by == "session" and found
            else {}
        )
    names.setdefault(DEFAULT_TENANT_ID, "default")
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    total = _zero()
    unpriced: set[str] = set()
    for tid, group, base_model, n, *counts in found:
        usage = dict(zip(COUNTERS, (int(c) for c in counts), strict=True))
        price = prices.get(base_model) if base_model else None
        if price is None and base_model and any(usage.values()):
            unpriced.add(base_model)
        cost = cost_usd(usage, price)
        label = names.get(tid, tid) if by is None else str(group)
        row = rows.setdefault(
            (tid, label), {"tenant": names.get(tid, tid), "key": label, **_zero()}
        )
        if by == "session":
            row["name"] = session_names.get(group) or ""
        for acc in (row, total):
            acc["requests"] += int(n)
            for c in COUNTERS:
                acc[c] += usage[c]
            acc["cost_usd"] += cost
    for acc in (*rows.values(), total):
        acc["cost_usd"] = round(acc["cost_usd"], 9)
    return {
        "by": by or "tenant",
        "since": since.isoformat() if since else None,
        "rows": sorted(rows.values(), key=lambda x: (x["tenant"], x["key"])),
        "total": total,
        "prices_per_million": {m: p.model_dump() for m, p in prices.items()},
        "unpriced_models": sorted(unpriced),
    }


def _zero() -> dict[str, Any]:
    return {"requests": 0, **dict.fromkeys(COUNTERS, 0), "cost_usd": 0.0}


def format_report(report: dict[str, Any]) -> str:
    """The report as a text table (the `treadle usage` command)."""
    named = report["by"] == "session"  # a session's row also shows its name
    head = ["tenant", report["by"], *(["name"] if named else [])]
    head += ["requests", "prefill", "sample", "train", "cached", "cost $"]
    lines = [head]
    for row in report["rows"]:
        lines.append(
            [
                row["tenant"],
                row["key"],
                *([row.get("name", "")] if named else []),
                str(row["requests"]),
                *(str(row[c]) for c in COUNTERS),
                f"{row['cost_usd']:.6f}",
            ]
        )
    t = report["total"]
    lines.append(
        ["total", "", *([""] if named else []), str(t["requests"])]
        + [*(str(t[c]) for c in COUNTERS), f"{t['cost_usd']:.6f}"]
    )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)) for line in lines]
    if report["unpriced_models"]:
        out.append(f"no price for: {', '.join(report['unpriced_models'])} (counted at $0)")
    return "\n".join(out)
