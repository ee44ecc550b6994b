"""The console's read model: what each page and JSON endpoint of /console shows, as plain
dicts, read from the database with SQLAlchemy Core and the live figures in memory.

Every function takes `scope`: the tenant_id whose data may be shown, or None for an admin
(every tenant). Scoping is explicit in every statement: these reads bypass the ORM's
per-request tenant filter (treadle.server.tenancy.auth) on purpose, so that an admin sees
all, and each one must therefore filter on its own. A session of another tenant is the
same NotFoundError as one that does not exist.

ConsoleViews puts the pages together: the overview, checkpoints and usage here, the session
pages in sessions.py (SessionViews), what every read shares in views_base.py.
"""

from __future__ import annotations

import datetime as dt
import os
import time
from collections import defaultdict
from typing import Any

from sqlalchemy import func, select

from treadle.server.console.sessions import SESSION_SORTS as SESSION_SORTS  # re-exported
from treadle.server.console.sessions import SessionViews
from treadle.server.console.views_base import OPS, C, G, M, S, V, _iso, _iso_ts, _scoped, _version
from treadle.server.engines.client import overall
from treadle.server.tenancy import metering

RECENT_S = 15 * 60  # the overview's window
BUCKET_S = 30  # tokens/s and requests per minute, in buckets of this many seconds


class ConsoleViews(SessionViews):
    """Every page of the console: the overview, checkpoints and usage (below), the session
    pages (SessionViews)."""

    # ---- overview ----
    def overview(self, scope: str | None) -> dict[str, Any]:
        now = time.time()
        since = now - RECENT_S
        with self._conn() as conn:
            ops = conn.execute(
                _scoped(
                    select(
                        OPS.c.base_model,
                        OPS.c.kind,
                        OPS.c.status,
                        OPS.c.finished_at,
                        OPS.c.error,
                        OPS.c.session_id,
                        OPS.c.prompt_tokens,
                        OPS.c.sampled_tokens,
                        OPS.c.train_tokens,
                    ).where(OPS.c.finished_at >= since),
                    OPS,
                    scope,
                )
            ).all()
            active = conn.execute(
                _scoped(select(func.count()).select_from(S).where(S.c.status == "active"), S, scope)
            ).scalar_one()
            total = conn.execute(
                _scoped(select(func.count()).select_from(S), S, scope)
            ).scalar_one()
        n_buckets = RECENT_S // BUCKET_S
        edges = [now - (n_buckets - i) * BUCKET_S for i in range(n_buckets)]
        requests = [0] * n_buckets
        tokens: dict[str, list[int]] = defaultdict(lambda: [0] * n_buckets)
        errors = []
        for op in ops:
            i = min(n_buckets - 1, int((op.finished_at - edges[0]) // BUCKET_S))
            requests[i] += 1
            tokens[op.base_model or ""][i] += op.prompt_tokens + op.sampled_tokens + op.train_tokens
            if op.status != "done":
                errors.append(op)
        errors.sort(key=lambda op: -op.finished_at)
        engines = []
        for engine in self.engines.all():
            facts = engine.facts
            engines.append(
                {
                    "name": engine.name,
                    "status": overall(engine.status()),
                    "device": self.config.device,
                    "dtype": self.config.dtype,
                    "arch": facts.arch,
                    "vocab_size": facts.vocab_size,
                    "max_seq_len": facts.max_seq_len,
                    "max_lora_rank": facts.max_lora_rank,
                    "in_flight": self.recorder.in_flight(engine.name, scope),
                    "batch_sizes": self.recorder.batch_sizes(engine.name, scope),
                    "tokens_per_s": [
                        [round(t + BUCKET_S, 3), round(n / BUCKET_S, 3)]
                        for t, n in zip(edges, tokens[engine.name], strict=True)
                    ],
                    "tokens_per_s_last_minute": round(sum(tokens[engine.name][-2:]) / 60, 3),
                }
            )
        return {
            "time": now,
            "memory": memory(self.config.device),
            "engines": engines,
            "sessions": {"active": int(active), "total": int(total)},
            "requests_per_minute": [
                [round(t + BUCKET_S, 3), n * 60 / BUCKET_S]
                for t, n in zip(edges, requests, strict=True)
            ],
            "requests_last_minute": sum(requests[-2:]),
            "errors": {
                "last_15_min": len(errors),
                "recent": [
                    {
                        "time": _iso_ts(op.finished_at),
                        "kind": op.kind,
                        "session_id": op.session_id,
                        "message": op.error,
                    }
                    for op in errors[:10]
                ],
            },
        }

    # ---- checkpoints ----
    def checkpoints(self, scope: str | None) -> dict[str, Any]:
        with self._conn() as conn:
            names = self.tenant_names(conn)
            groups = conn.execute(
                _scoped(select(G).order_by(G.c.tenant_id, G.c.name), G, scope)
            ).all()
            versions = conn.execute(
                _scoped(select(V).order_by(V.c.group_name, V.c.version), V, scope)
            ).all()
            ckpts = conn.execute(
                _scoped(select(C).order_by(C.c.created_at.desc()).limit(500), C, scope)
            ).all()
            runs = (
                {
                    m.run_id: (m.session_id, m.display_name)  # its session, and its name
                    for m in conn.execute(
                        select(M.c.run_id, M.c.session_id, S.c.display_name)
                        .join(S, S.c.session_id == M.c.session_id)
                        .where(M.c.run_id.in_({c.run_id for c in ckpts}))
                    )
                }
                if ckpts
                else {}
            )
        by_group = defaultdict(list)
        for v in versions:
            by_group[(v.tenant_id, v.group_name)].append(_version(v))
        return {
            "groups": [
                {
                    "tenant": names.get(g.tenant_id, g.tenant_id),
                    "tenant_id": g.tenant_id,
                    "name": g.name,
                    "keep_last": g.keep_last,
                    "state_ttl_s": g.state_ttl_s,
                    "created": _iso(g.created_at),
                    "versions": by_group.get((g.tenant_id, g.name), []),
                    "size_bytes": sum(
                        v["size_bytes"] for v in by_group.get((g.tenant_id, g.name), [])
                    ),
                }
                for g in groups
            ],
            "checkpoints": [
                {
                    "tenant": names.get(c.tenant_id, c.tenant_id),
                    "tinker_path": c.tinker_path,
                    "name": c.name,
                    "type": c.checkpoint_type,
                    "base_model": c.base_model,
                    "session_id": runs.get(c.run_id, (None, None))[0],
                    "session_name": runs.get(c.run_id, (None, None))[1] or "",
                    "size_bytes": c.size_bytes,
                    "time": _iso(c.created_at),
                }
                for c in ckpts
            ],
        }

    # ---- usage ----
    def usage(
        self, scope: str | None, by: str | None = None, since: dt.datetime | None = None
    ) -> dict[str, Any]:
        """The usage report of the scope (what GET /api/v1/treadle/usage gives a tenant), its
        days for the chart, and the spend caps with what was spent under them."""
        engine, prices = self.store.engine, self.config.prices
        report = metering.usage_report(engine, prices, tenant_id=scope, since=since, by=by)
        days = metering.usage_report(engine, prices, tenant_id=scope, since=since, by="day")
        per_day: dict[str, dict[str, Any]] = {}
        for row in days["rows"]:
            acc = per_day.setdefault(
                row["key"],
                {"day": row["key"], "cost_usd": 0.0, **dict.fromkeys(metering.COUNTERS, 0)},
            )
            for c in metering.COUNTERS:
                acc[c] += row[c]
            acc["cost_usd"] = round(acc["cost_usd"] + row["cost_usd"], 9)
        with self._conn() as conn:
            names = self.tenant_names(conn)
        caps = self.spend.report(scope)
        for cap in caps:
            cap["tenant"] = names.get(cap["tenant_id"], cap["tenant_id"])
        return {**report, "days": sorted(per_day.values(), key=lambda d: d["day"]), "caps": caps}


def memory(device: str) -> dict[str, Any]:
    """The server process's resident memory, and the accelerator's when it runs on one."""
    out: dict[str, Any] = {"rss_bytes": _rss_bytes()}
    if device.startswith("cuda"):
        try:
            import torch

            free, total = torch.cuda.mem_get_info(torch.device(device))
            out["device_allocated_bytes"] = int(torch.cuda.memory_allocated(torch.device(device)))
            out["device_used_bytes"] = int(total - free)
            out["device_total_bytes"] = int(total)
        except Exception as e:  # noqa: BLE001 - a figure of the page, never its failure
            out["device_error"] = f"{type(e).__name__}: {e}"
    return out


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
