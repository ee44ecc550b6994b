"""The console's read model: what each page and JSON endpoint of /console shows, as plain
dicts, read from the database with SQLAlchemy Core and the live figures in memory.

Every function takes `scope`: the tenant_id whose data may be shown, or None for an admin
(every tenant). Scoping is explicit in every statement: these reads bypass the ORM's
per-request tenant filter (treadle.server.tenancy.auth) on purpose, so that an admin sees
all, and each one must therefore filter on its own. A session of another tenant is the
same NotFoundError as one that does not exist.
"""

from __future__ import annotations

import datetime as dt
import os
import time
from collections import defaultdict
from typing import Any

from sqlalchemy import Connection, and_, case, func, select

from treadle.errors import NotFoundError
from treadle.server.config import ServerConfig
from treadle.server.core import timeline
from treadle.server.core.engines import Engines
from treadle.server.core.metrics import SERVER_FIGURES, Metrics
from treadle.server.storage.database import Store
from treadle.server.storage.rows import (
    DEFAULT_TENANT_ID,
    CheckpointRow,
    ModelRow,
    OpRecordRow,
    PackageGroupRow,
    RequestRow,
    SessionRow,
    StepFigureRow,
    TenantRow,
    VersionRow,
)
from treadle.server.tenancy import metering
from treadle.server.tenancy.spend import SpendBook

S, M, R = SessionRow.__table__, ModelRow.__table__, RequestRow.__table__
OPS, F = OpRecordRow.__table__, StepFigureRow.__table__
C, G, V = CheckpointRow.__table__, PackageGroupRow.__table__, VersionRow.__table__

RECENT_S = 15 * 60  # the overview's window
BUCKET_S = 30  # tokens/s and requests per minute, in buckets of this many seconds
MAX_SESSIONS = 500
MAX_POINTS = 2000  # per curve; longer curves are thinned
TIMELINE_OPS = 300  # drawn on the session page
SUMMARY_OPS = 2000  # percentiles over the session's last ops
SESSION_SORTS = (
    "created",
    "last_activity",
    "steps",
    "tenant",
    "name",
    "base_model",
    "status",
    "cost_usd",
)


class ConsoleViews:
    def __init__(
        self,
        config: ServerConfig,
        store: Store,
        engines: Engines,
        metrics: Metrics,
        spend: SpendBook,
    ):
        self.config = config
        self.store = store
        self.engines = engines
        self.metrics = metrics
        self.spend = spend

    def _conn(self) -> Any:
        return self.store.engine.connect()

    def tenant_names(self, conn: Connection) -> dict[str, str]:
        names = dict(conn.execute(select(TenantRow.tenant_id, TenantRow.name)).all())
        names.setdefault(DEFAULT_TENANT_ID, "default")
        return names

    def tenant_id_of(self, name_or_id: str | None) -> str | None:
        """An admin's ?tenant= filter (a name or an id); unknown → a tenant that has nothing."""
        if not name_or_id:
            return None
        with self._conn() as conn:
            for tid, name in self.tenant_names(conn).items():
                if name_or_id in (tid, name):
                    return tid
        return f"unknown:{name_or_id}"

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
            status = getattr(engine, "status", None)
            engines.append(
                {
                    "name": engine.name,
                    "status": status() if callable(status) else "serving",
                    "device": self.config.device,
                    "dtype": self.config.dtype,
                    "arch": facts.arch,
                    "vocab_size": facts.vocab_size,
                    "max_seq_len": facts.max_seq_len,
                    "max_lora_rank": facts.max_lora_rank,
                    "in_flight": self.metrics.in_flight(engine.name, scope),
                    "batch_sizes": self.metrics.batch_sizes(engine.name, scope),
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

    # ---- sessions ----
    def sessions(
        self,
        scope: str | None,
        q: str | None = None,
        status: str | None = None,
        sort: str = "created",
        desc: bool = True,
        limit: int = 200,
    ) -> dict[str, Any]:
        if sort not in SESSION_SORTS:
            raise ValueError(f"sort: expected one of {list(SESSION_SORTS)}, got {sort!r}")
        with self._conn() as conn:
            stmt = select(S).order_by(S.c.created_at.desc()).limit(MAX_SESSIONS * (4 if q else 1))
            if status:
                stmt = stmt.where(S.c.status == status)
            found = [dict(r._mapping) for r in conn.execute(_scoped(stmt, S, scope))]
            rows = self._session_rows(conn, found)
        if q:
            needle = q.lower()
            rows = [r for r in rows if needle in _haystack(r)]
        rows.sort(key=lambda r: _sort_key(r, sort), reverse=desc)
        return {"sessions": rows[:limit], "count": len(rows), "sort": sort, "desc": desc}

    def _session_rows(self, conn: Connection, found: list[dict[str, Any]]) -> list[dict[str, Any]]:
        ids = [r["session_id"] for r in found]
        if not ids:
            return []
        names = self.tenant_names(conn)
        models = defaultdict(list)
        for m in conn.execute(select(M).where(M.c.session_id.in_(ids)).order_by(M.c.created_at)):
            models[m.session_id].append(m)
        optim = and_(R.c.kind == "optim_step", R.c.status == "done")
        activity = {
            sid: (steps, last)
            for sid, steps, last in conn.execute(
                select(
                    R.c.session_id,
                    func.sum(case((optim, 1), else_=0)),
                    func.max(func.coalesce(R.c.finished_at, R.c.created_at)),
                )
                .where(R.c.session_id.in_(ids))
                .group_by(R.c.session_id)
            )
        }
        costs = self._costs(conn, ids)
        out = []
        for s in found:
            sid = s["session_id"]
            ms = models.get(sid, [])
            steps, last = activity.get(sid, (0, None))
            lora = ms[0].lora_config if ms else {}
            out.append(
                {
                    "session_id": sid,
                    "tenant": names.get(s["tenant_id"], s["tenant_id"]),
                    "name": s["display_name"] or "",
                    "base_model": ", ".join(sorted({m.base_model for m in ms})),
                    "rank": lora.get("rank"),
                    "alpha": lora.get("alpha"),
                    "models": len(ms),
                    "steps": int(steps or 0),
                    "created": _iso(s["created_at"]),
                    "last_activity": _iso(last or s["created_at"]),
                    "status": s["status"],
                    "cost_usd": round(costs.get(sid, {}).get("cost_usd", 0.0), 9),
                    "tokens": costs.get(sid, {}).get("tokens", 0),
                }
            )
        return out

    def _costs(self, conn: Connection, session_ids: list[str]) -> dict[str, dict[str, Any]]:
        """Metered tokens and cost per session (as the usage report counts them)."""
        cols = [func.coalesce(func.sum(R.c[metering.COLUMN_OF[c]]), 0) for c in metering.COUNTERS]
        stmt = (
            select(R.c.session_id, R.c.base_model, *cols)
            .where(R.c.session_id.in_(session_ids) & (R.c.status == "done"))
            .group_by(R.c.session_id, R.c.base_model)
        )
        out: dict[str, dict[str, Any]] = defaultdict(
            lambda: {"cost_usd": 0.0, "tokens": 0, **dict.fromkeys(metering.COUNTERS, 0)}
        )
        for sid, base_model, *counts in conn.execute(stmt):
            usage = dict(zip(metering.COUNTERS, (int(c) for c in counts), strict=True))
            acc = out[sid]
            acc["cost_usd"] += metering.cost_usd(usage, self.config.prices.get(base_model or ""))
            acc["tokens"] += sum(usage.values())
            for c in metering.COUNTERS:
                acc[c] += usage[c]
        return dict(out)

    def _session_row(self, conn: Connection, scope: str | None, session_id: str) -> dict:
        row = conn.execute(_scoped(select(S).where(S.c.session_id == session_id), S, scope)).first()
        if row is None:
            raise NotFoundError(f"session {session_id!r} not found")
        return dict(row._mapping)

    def session(self, scope: str | None, session_id: str) -> dict[str, Any]:
        """One session: its row, models, usage and cost so far, checkpoints and versions."""
        with self._conn() as conn:
            found = self._session_row(conn, scope, session_id)
            (row,) = self._session_rows(conn, [found])
            models = conn.execute(
                select(M).where(M.c.session_id == session_id).order_by(M.c.created_at)
            ).all()
            usage = self._costs(conn, [session_id]).get(session_id, {})
            run_ids = [m.run_id for m in models]
            ckpts = (
                conn.execute(
                    select(C).where(C.c.run_id.in_(run_ids)).order_by(C.c.created_at.desc())
                ).all()
                if run_ids
                else []
            )
            versions = conn.execute(
                select(V).where(V.c.session_id == session_id).order_by(V.c.created_at.desc())
            ).all()
            last_step = conn.execute(
                select(func.max(F.c.step)).where(F.c.session_id == session_id)
            ).scalar_one()
        return {
            **row,
            "user_metadata": found["user_metadata"],
            "tags": found["tags"],
            "ended_at": _iso(found["ended_at"]),
            "last_step": last_step,
            "usage": {c: usage.get(c, 0) for c in metering.COUNTERS},
            "models": [
                {
                    "model_id": m.model_id,
                    "label": timeline.model_label(m.model_id),
                    "base_model": m.base_model,
                    "rank": m.lora_config.get("rank"),
                    "alpha": m.lora_config.get("alpha"),
                    "status": m.status,
                    "training_run_id": m.run_id,
                    "created": _iso(m.created_at),
                }
                for m in models
            ],
            "checkpoints": [
                {
                    "tinker_path": c.tinker_path,
                    "name": c.name,
                    "type": c.checkpoint_type,
                    "size_bytes": c.size_bytes,
                    "time": _iso(c.created_at),
                }
                for c in ckpts
            ],
            "versions": [_version(v) for v in versions],
        }

    def curves(self, scope: str | None, session_id: str, since_step: int = 0) -> dict[str, Any]:
        """The session's figures per step from `since_step` on: {"series": {name: {"steps",
        "values"}}}; a session with several models names a curve "<name> (model n)"."""
        with self._conn() as conn:
            self._session_row(conn, scope, session_id)
            rows = conn.execute(
                select(F.c.model_id, F.c.step, F.c.name, F.c.value, F.c.source)
                .where((F.c.session_id == session_id) & (F.c.step >= since_step))
                .order_by(F.c.step, F.c.id)
            ).all()
        models = sorted({r.model_id for r in rows})
        series: dict[str, dict[str, list]] = {}
        sources: dict[str, str] = {}
        for r in rows:
            name = r.name if len(models) < 2 else f"{r.name} ({timeline.model_label(r.model_id)})"
            s = series.setdefault(name, {"steps": [], "values": []})
            if s["steps"] and s["steps"][-1] == r.step:
                s["values"][-1] = r.value  # a re-reported step: the last value
            else:
                s["steps"].append(r.step)
                s["values"].append(r.value)
            sources[name] = r.source
        for s in series.values():
            if len(s["steps"]) > MAX_POINTS:  # thin, keeping the last point
                stride = -(-len(s["steps"]) // MAX_POINTS)
                keep = list(range(len(s["steps"]) - 1, -1, -stride))[::-1]
                s["steps"] = [s["steps"][i] for i in keep]
                s["values"] = [s["values"][i] for i in keep]
        last = max((s["steps"][-1] for s in series.values() if s["steps"]), default=None)
        return {
            "session_id": session_id,
            "since_step": since_step,
            "last_step": last,
            "series": dict(sorted(series.items(), key=lambda kv: _curve_order(kv[0]))),
            "sources": sources,
        }

    def ops(self, scope: str | None, session_id: str, limit: int) -> list[dict[str, Any]]:
        """The session's last `limit` ops, oldest first."""
        with self._conn() as conn:
            self._session_row(conn, scope, session_id)
            rows = conn.execute(
                select(OPS)
                .where(OPS.c.session_id == session_id)
                .order_by(OPS.c.queued_at.desc())
                .limit(limit)
            ).all()
        return [dict(r._mapping) for r in reversed(rows)]

    def timeline(self, scope: str | None, session_id: str, limit: int = TIMELINE_OPS) -> dict:
        ops = self.ops(scope, session_id, max(limit, SUMMARY_OPS))
        shown = ops[-limit:]
        return {
            "session_id": session_id,
            "summary": timeline.summarize(ops),
            "summary_ops": len(ops),
            "ops": [
                {
                    **{
                        k: op[k]
                        for k in (
                            "request_id",
                            "kind",
                            "status",
                            "model_id",
                            "step",
                            "batch_ops",
                            "error",
                        )
                    },
                    "queued_at": op["queued_at"],
                    "started_at": op["started_at"],
                    "finished_at": op["finished_at"],
                    "wait_ms": round(timeline.wait_s(op) * 1e3, 3),
                    "run_ms": round(timeline.run_s(op) * 1e3, 3),
                    "tokens": op["prompt_tokens"] + op["sampled_tokens"] + op["train_tokens"],
                }
                for op in shown
            ],
        }

    def trace(self, scope: str | None, session_id: str, limit: int = 100_000) -> dict[str, Any]:
        ops = self.ops(scope, session_id, limit)
        return timeline.chrome_trace(ops, f"treadle session {session_id}")

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
                    m.run_id: m.session_id
                    for m in conn.execute(
                        select(M.c.run_id, M.c.session_id).where(
                            M.c.run_id.in_({c.run_id for c in ckpts})
                        )
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
                    "session_id": runs.get(c.run_id),
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


def _scoped(stmt: Any, table: Any, scope: str | None) -> Any:
    return stmt if scope is None else stmt.where(table.c.tenant_id == scope)


def _version(v: Any) -> dict[str, Any]:
    return {
        "ref": f"{v.group_name}:{v.version}",
        "group": v.group_name,
        "version": v.version,
        "kind": v.kind,
        "name": v.name,
        "step": v.step,
        "size_bytes": v.size_bytes,
        "time": _iso(v.created_at),
        "session_id": v.session_id,
        "encrypted": bool(v.encrypted),
        "tenant_id": v.tenant_id,
    }


def _iso(when: dt.datetime | None) -> str | None:
    if when is None:
        return None
    if isinstance(when, str):
        return when
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return when.isoformat(timespec="seconds")


def _iso_ts(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).isoformat(timespec="seconds")


def _curve_order(name: str) -> tuple[int, int, str]:
    """The loop's own curves first, by name; then the server's, the loss first."""
    figure = name.split(" (model ")[0]
    if figure in SERVER_FIGURES:
        return (1, SERVER_FIGURES.index(figure), name)
    return (0, 0, name)


def _haystack(row: dict[str, Any]) -> str:
    return " ".join(
        str(row[k]) for k in ("session_id", "tenant", "name", "base_model", "status")
    ).lower()


def _sort_key(row: dict[str, Any], sort: str) -> Any:
    value = row[sort]
    return (value is not None, value if value is not None else 0)
