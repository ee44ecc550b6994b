"""A session's op timeline as a trace file (`RestClient.export_session_trace`): one track per
training run and sampling session, one slice per request from filed to finished (and, where
the console recorded it, a nested slice for its engine call), in the Trace Event Format
(JSON) that ui.perfetto.dev and chrome://tracing open.

It is built when its signed link is fetched (the signature is the grant; it names the
session and its tenant), so the export is ready at once and always current.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import select

from treadle.server.core.lifetime import aware
from treadle.server.storage.database import Store
from treadle.server.storage.rows import OpRecordRow, RequestRow

MAX_EVENTS = 200_000  # the newest requests of a very long session


def trace(store: Store, tenant_id: str, session_id: str) -> dict[str, Any]:
    r, o = RequestRow.__table__, OpRecordRow.__table__
    with store.engine.connect() as conn:
        rows = conn.execute(
            select(
                r.c.request_id,
                r.c.kind,
                r.c.model_id,
                r.c.sampling_session_id,
                r.c.status,
                r.c.created_at,
                r.c.finished_at,
                r.c.prompt_tokens,
                r.c.sampled_tokens,
                r.c.train_tokens,
                o.c.started_at,
                o.c.finished_at.label("ran_until"),
            )  # fmt: skip
            .select_from(r.outerjoin(o, o.c.request_id == r.c.request_id))
            .where((r.c.tenant_id == tenant_id) & (r.c.session_id == session_id))
            .order_by(r.c.created_at.desc())
            .limit(MAX_EVENTS)
        ).all()
    tracks: dict[str, int] = {}
    events: list[dict[str, Any]] = []
    for row in reversed(rows):
        track = row.model_id or row.sampling_session_id or "session"
        tid = tracks.setdefault(track, len(tracks) + 1)
        start = _us(row.created_at)
        end = _us(row.finished_at) if row.finished_at is not None else start
        args = {
            "request_id": row.request_id,
            "status": row.status,
            "prefill_tokens": row.prompt_tokens,
            "sample_tokens": row.sampled_tokens,
            "train_tokens": row.train_tokens,
        }
        events.append(_slice(row.kind, start, end, tid, args))
        if row.started_at is not None and row.ran_until is not None:
            ran = _slice("engine", row.started_at * 1e6, row.ran_until * 1e6, tid, {})
            events.append(ran)
    names = [
        {"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": track}}
        for track, tid in tracks.items()
    ]
    process = {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": session_id}}
    return {"traceEvents": [process, *names, *events], "displayTimeUnit": "ms"}


def _slice(name: str, start: float, end: float, tid: int, args: dict) -> dict[str, Any]:
    return {
        "name": name,
        "ph": "X",
        "pid": 1,
        "tid": tid,
        "ts": start,
        "dur": max(0.0, end - start),
        "args": args,
    }


def _us(when: dt.datetime) -> float:
    return aware(when).timestamp() * 1e6  # type: ignore[union-attr]
