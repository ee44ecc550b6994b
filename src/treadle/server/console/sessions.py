"""The console's session pages: the sessions list, one session, its curves and its ops.

SessionViews reads sessions with their models, activity and metered cost (_session_rows,
_costs), a session's figures per step as curves (thinned past MAX_POINTS), and its op
records as a timeline or a Chrome trace (treadle.server.console.timeline). Every read is
scoped like the rest of the console (treadle.server.console.views).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from sqlalchemy import Connection, and_, case, func, select

from treadle.errors import NotFoundError
from treadle.server.console import timeline
from treadle.server.console.figures import SERVER_FIGURES
from treadle.server.console.views_base import (
    OPS,
    C,
    F,
    M,
    R,
    S,
    V,
    ViewsBase,
    _iso,
    _scoped,
    _version,
)
from treadle.server.tenancy import metering

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


class SessionViews(ViewsBase):
    """The sessions list and one session's page, curves, ops, timeline and trace."""

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
