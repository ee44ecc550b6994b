"""Search: checkpoints (the newer SDKs' `RestClient.search_checkpoints`, and the treadle
SDK) and sessions (`RestClient.search_sessions`), newest first, with cursor paging.

A page is the first `limit` matches after the cursor (the last item of the previous page:
its time and id, so that items made in the same instant are neither skipped nor repeated),
and `next_cursor` is set when more may follow. Filters that SQL can hold are SQL; exact
user_metadata pairs are checked on the rows as they stream by, so a page never costs more
than the rows up to its last match.

Owners: a tenant's own, or "accessible": its own and the checkpoints other tenants
published (sessions are only ever their tenant's). A tenant's owner URN is
`treadle:tenant:<tenant_id>`.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from typing import Any

from sqlalchemy import Select, and_, func, or_, select

from treadle.errors import InvalidRequestError
from treadle.server.core.lifetime import aware
from treadle.server.storage.database import Store
from treadle.server.storage.rows import CheckpointRow, ModelRow, SessionRow
from treadle.wire.sdk_requests import CheckpointSearchRequest, SessionSearchRequest

SCAN = 500  # rows read per batch while metadata filters are checked


def owner_urn(tenant_id: str) -> str:
    return f"treadle:tenant:{tenant_id}"


def _project():
    s, m = SessionRow.__table__, ModelRow.__table__
    return func.coalesce(s.c.project_id, m.c.project_id)


def checkpoints(
    store: Store, tenant_id: str, q: CheckpointSearchRequest
) -> tuple[list[CheckpointRow], tuple[dt.datetime, str] | None]:
    """→ (one page of checkpoints, newest first; the cursor after it or None)."""
    c, m, s = CheckpointRow.__table__, ModelRow.__table__, SessionRow.__table__
    owned = c.c.tenant_id == tenant_id
    where = [c.c.expired_at.is_(None), or_(owned, c.c.public) if q.owner == "accessible" else owned]
    if q.checkpoint_type is not None:
        where.append(c.c.checkpoint_type == q.checkpoint_type)
    if q.base_model is not None:
        where.append(c.c.base_model == q.base_model)
    if q.training_run_id is not None:
        where.append(c.c.run_id == q.training_run_id)
    if q.project_id is not None:
        where.append(_project() == q.project_id)
    if q.cursor is not None:
        at = _utc(q.cursor.last_time)
        last = q.cursor.last_tinker_path
        where.append(or_(c.c.created_at < at, and_(c.c.created_at == at, c.c.tinker_path < last)))
    stmt = (
        select(c)
        .select_from(
            c.outerjoin(m, m.c.model_id == c.c.model_id).outerjoin(
                s, s.c.session_id == m.c.session_id
            )
        )
        .where(*where)
        .order_by(c.c.created_at.desc(), c.c.tinker_path.desc())
    )
    rows = _page(store, stmt, q.user_metadata, q.limit)
    found = [CheckpointRow(**r) for r in rows[: q.limit]]
    more = len(rows) > q.limit
    cursor = (aware(found[-1].created_at), found[-1].tinker_path) if more else None
    return found, cursor  # type: ignore[return-value]


def sessions(
    store: Store, tenant_id: str, q: SessionSearchRequest
) -> tuple[list[dict[str, Any]], tuple[dt.datetime, str] | None]:
    """→ (one page of sessions as SessionSummary fields, newest first; the next cursor)."""
    s = SessionRow.__table__
    owner = q.owner.get("type", "own")
    if owner not in ("own", "accessible", "user"):
        raise InvalidRequestError(f"owner.type: expected own, accessible or user, got {owner!r}")
    where = [s.c.tenant_id == tenant_id]
    if owner == "user" and owner_urn(tenant_id) not in (q.owner.get("owner_urns") or []):
        where.append(s.c.session_id.is_(None))  # other owners' sessions: none visible
    match = []
    if q.session_id is not None:
        match.append(s.c.session_id == q.session_id)
    if q.display_name is not None:
        words = [w.lower() for w in q.display_name.split()]
        match.append(and_(*(func.lower(s.c.display_name).contains(w) for w in words)))
    if match:
        where.append(or_(*match))
    if q.project_ids is not None:
        where.append(s.c.project_id.in_(q.project_ids))
    if q.statuses is not None:  # failed and cancelled sessions do not exist here
        wanted = {status for x in q.statuses if (status := _status_of_query(x)) is not None}
        where.append(s.c.status.in_(wanted))
    if q.cursor is not None:
        at, last = _utc(q.cursor.last_created_at), q.cursor.last_session_id
        where.append(or_(s.c.created_at < at, and_(s.c.created_at == at, s.c.session_id < last)))
    stmt = select(s).where(*where).order_by(s.c.created_at.desc(), s.c.session_id.desc())
    rows = _page(store, stmt, q.user_metadata, q.limit)
    page = rows[: q.limit]
    stored = _stored(store, [r["session_id"] for r in page])
    found = [_summary(r, stored.get(r["session_id"], (0, 0))) for r in page]
    more = len(rows) > q.limit
    cursor = (aware(page[-1]["created_at"]), page[-1]["session_id"]) if more else None
    return found, cursor  # type: ignore[return-value]


def _page(store: Store, stmt: Select, metadata: dict[str, str], limit: int) -> list[dict]:
    """Up to limit + 1 rows of `stmt` whose user_metadata holds every pair of `metadata`."""
    out: list[dict] = []
    for row in _scan(store, stmt):
        have = row.get("user_metadata") or {}
        if all(str(have.get(k)) == v and k in have for k, v in metadata.items()):
            out.append(row)
            if len(out) > limit:
                break
    return out


def _scan(store: Store, stmt: Select) -> Iterator[dict]:
    offset = 0
    while True:
        with store.engine.connect() as conn:
            batch = [dict(r._mapping) for r in conn.execute(stmt.offset(offset).limit(SCAN))]
        yield from batch
        if len(batch) < SCAN:
            return
        offset += SCAN


def _status_of_query(query: dict[str, Any]) -> str | None:
    """A SessionStatusQuery → the status column it matches (None: none here)."""
    kinds = {"active": "active", "client_finished": "finished", "failed": None, "cancelled": None}
    kind = query.get("type")
    if kind not in kinds:
        raise InvalidRequestError(f"statuses: unknown status {kind!r}")
    return kinds[kind]


def _stored(store: Store, session_ids: list[str]) -> dict[str, tuple[int, int]]:
    """Per session: its live checkpoints and their bytes."""
    if not session_ids:
        return {}
    c, m = CheckpointRow.__table__, ModelRow.__table__
    stmt = (
        select(m.c.session_id, func.count(), func.coalesce(func.sum(c.c.size_bytes), 0))
        .select_from(c.join(m, m.c.model_id == c.c.model_id))
        .where(m.c.session_id.in_(session_ids) & c.c.expired_at.is_(None))
        .group_by(m.c.session_id)
    )
    with store.engine.connect() as conn:
        return {sid: (int(n), int(size)) for sid, n, size in conn.execute(stmt)}


def _summary(row: dict[str, Any], stored: tuple[int, int]) -> dict[str, Any]:
    status = {
        "active": {"type": "active"},
        "finished": {"type": "client_finished", "reason": {"type": "success"}},
    }.get(row["status"])  # expired (silent past the heartbeat timeout): neither
    metadata = row.get("user_metadata")
    return {
        "session_id": row["session_id"],
        "created_at": aware(row["created_at"]),
        "owner": owner_urn(row["tenant_id"]),
        "project_id": row.get("project_id") or "",
        "status": status,
        "checkpoints_count": stored[0],
        "display_name": row.get("display_name"),
        "user_metadata": {k: str(v) for k, v in metadata.items()} if metadata else None,
        "checkpoint_storage_bytes": stored[1],
    }


def _utc(when: dt.datetime) -> dt.datetime:
    return when.astimezone(dt.UTC)
