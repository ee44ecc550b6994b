"""The statements of the hot path, in SQLAlchemy Core: no ORM session, no identity map, one
statement each. They are functions of a Connection, run by the journal thread
(treadle.server.storage.journal) or in a short transaction of their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, bindparam, delete, insert, select, true, update

from treadle.server.storage.rows import (
    Base,
    ModelRow,
    RequestRow,
    SamplingSessionRow,
    SessionRow,
    StateSnapshotRow,
    utcnow,
)

REQUESTS = RequestRow.__table__
# The columns an outcome sets; every outcome fills all of them so that one executemany
# statement writes a whole round of results.
OUTCOME_COLUMNS = (
    "status",
    "result",
    "content_type",
    "error",
    "prompt_tokens",
    "sampled_tokens",
    "train_tokens",
    "cached_prompt_tokens",
)
# Built once: the statement of every submit (building it anew cost 10-25 µs of a 40-55 µs
# execute, measured on a warm core)
_INSERT_REQUEST = insert(REQUESTS)
_FINISH = (
    update(REQUESTS)
    .where(REQUESTS.c.request_id == bindparam("rid"))
    .values({c: bindparam(c) for c in (*OUTCOME_COLUMNS, "finished_at")})
)


def insert_row(conn: Connection, cls: type[Base], values: dict[str, Any]) -> None:
    """One INSERT of a row given as column values (column defaults apply)."""
    conn.execute(insert(cls.__table__), values)


def name_session(conn: Connection, session_id: str, name: str) -> None:
    """Give a session its display name, unless it has one (the first name given wins)."""
    s = SessionRow.__table__
    conn.execute(
        update(s)
        .where((s.c.session_id == session_id) & s.c.display_name.is_(None))
        .values(display_name=name)
    )


@dataclass
class Finished:
    """The columns a finished request's row gets: its result body or its error, and usage."""

    request_id: str
    status: str  # done | failed
    result: bytes | None = None
    content_type: str | None = None
    error: dict[str, Any] | None = None
    prompt_tokens: int = 0
    sampled_tokens: int = 0
    train_tokens: int = 0
    cached_prompt_tokens: int = 0


def finish_requests(conn: Connection, finished: list[Finished]) -> None:
    """Write the outcomes of finished requests (one executemany statement)."""
    now = utcnow()
    rows = []
    for f in finished:
        values = {c: getattr(f, c) for c in OUTCOME_COLUMNS}
        rows.append({"rid": f.request_id, **values, "finished_at": now})
    conn.execute(_FINISH, rows)


def request_id_of(conn: Connection, dedup_key: str) -> str | None:
    """The request already filed under a dedup key, if any."""
    stmt = select(REQUESTS.c.request_id).where(REQUESTS.c.dedup_key == dedup_key)
    return conn.execute(stmt).scalar_one_or_none()


def request_row(conn: Connection, request_id: str) -> dict[str, Any] | None:
    """A request's columns as a dict (for futures this process no longer holds in memory)."""
    row = conn.execute(select(REQUESTS).where(REQUESTS.c.request_id == request_id)).first()
    return dict(row._mapping) if row is not None else None


def insert_request(conn: Connection, values: dict[str, Any]) -> str:
    """File a future; → its request_id."""
    conn.execute(_INSERT_REQUEST, values)
    return values["request_id"]


def sampling_session_id_of(conn: Connection, key: tuple[str, int]) -> str | None:
    """The sampling session already made for (session_id, sampling_session_seq_id)."""
    table = SamplingSessionRow.__table__
    stmt = select(table.c.sampling_session_id).where(
        (table.c.session_id == key[0]) & (table.c.seq_id == key[1])
    )
    return conn.execute(stmt).scalar_one_or_none()


def insert_sampler_once(conn: Connection, values: dict[str, Any]) -> None:
    """A sampling session row, unless it exists (a snapshot op replayed after a restart)."""
    table = SamplingSessionRow.__table__
    key = table.c.sampling_session_id == values["sampling_session_id"]
    if conn.execute(select(table.c.sampling_session_id).where(key)).first() is None:
        insert_row(conn, SamplingSessionRow, values)


def mark_session_ended(conn: Connection, session_id: str, status: str) -> tuple[list, list]:
    """Mark a session and its models ended; → its (model_id, base_model) and its
    (sampling_session_id, base_model, engine_ref)."""
    sessions, models = SessionRow.__table__, ModelRow.__table__
    conn.execute(
        update(sessions)
        .where(sessions.c.session_id == session_id)
        .values(status=status, ended_at=utcnow())
    )
    held = session_holdings(conn, session_id)
    conn.execute(update(models).where(models.c.session_id == session_id).values(status="unloaded"))
    return held


def session_holdings(conn: Connection, session_id: str) -> tuple[list, list]:
    """A session's (model_id, base_model) and (sampling_session_id, base_model, engine_ref)."""
    models, samplers = ModelRow.__table__, SamplingSessionRow.__table__
    model_rows = conn.execute(
        select(models.c.model_id, models.c.base_model).where(models.c.session_id == session_id)
    ).all()
    sampler_rows = conn.execute(
        select(samplers.c.sampling_session_id, samplers.c.base_model, samplers.c.engine_ref).where(
            samplers.c.session_id == session_id
        )
    ).all()
    return [tuple(r) for r in model_rows], [tuple(r) for r in sampler_rows]


def set_model_status(
    conn: Connection, model_id: str, status: str, reason: str | None = None
) -> None:
    """active | unloaded; `reason`: why the server unloaded it (ModelRow.unloaded_reason)."""
    models = ModelRow.__table__
    values = {"status": status, "unloaded_reason": reason}
    conn.execute(update(models).where(models.c.model_id == model_id).values(values))


# ---- listings of the RestClient ----
def session_ids(conn: Connection, tenant_id: str, limit: int, offset: int) -> list[str]:
    """The tenant's sessions, newest first."""
    t = SessionRow.__table__
    stmt = (
        select(t.c.session_id)
        .where(t.c.tenant_id == tenant_id)
        .order_by(t.c.created_at.desc())
        .offset(offset)
        .limit(limit)
    )
    return list(conn.execute(stmt).scalars())


def session_detail(
    conn: Connection, tenant_id: str, session_id: str
) -> tuple[dict[str, Any], list[str], list[str]] | None:
    """A session of the tenant: (its columns, its model ids, its sampling session ids)."""
    t = SessionRow.__table__
    found = conn.execute(
        select(t).where((t.c.session_id == session_id) & (t.c.tenant_id == tenant_id))
    ).first()
    if found is None:
        return None
    models, samplers = ModelRow.__table__, SamplingSessionRow.__table__
    model_ids = conn.execute(
        select(models.c.model_id).where(models.c.session_id == session_id)
    ).scalars()
    sampler_ids = conn.execute(
        select(samplers.c.sampling_session_id).where(samplers.c.session_id == session_id)
    ).scalars()
    return dict(found._mapping), list(model_ids), list(sampler_ids)


# ---- recovery: the op log and state snapshots ----
def model_ops_after(conn: Connection, model_id: str, seq_id: int) -> list[dict[str, Any]]:
    """A model's filed ops after seq_id, in seq_id order: (request_id, kind, seq_id, status,
    tenant_id, payload)."""
    r = REQUESTS
    stmt = (
        select(r.c.request_id, r.c.kind, r.c.seq_id, r.c.status, r.c.tenant_id, r.c.payload)
        .where((r.c.model_id == model_id) & (r.c.seq_id > seq_id) & (r.c.kind != "unload"))
        .order_by(r.c.seq_id)
    )
    return [dict(row._mapping) for row in conn.execute(stmt)]


def pending_samples(conn: Connection, base_model: str) -> list[dict[str, Any]]:
    """Sample requests filed for a served model and not finished."""
    r = REQUESTS
    stmt = select(r.c.request_id, r.c.tenant_id, r.c.payload).where(
        (r.c.kind == "sample") & (r.c.status == "pending") & (r.c.base_model == base_model)
    )
    return [dict(row._mapping) for row in conn.execute(stmt)]


def pending_requests(conn: Connection) -> list[dict[str, Any]]:
    """Every unfinished request: (request_id, kind, tenant_id, model_id, payload is null)."""
    r = REQUESTS
    columns = (r.c.request_id, r.c.kind, r.c.tenant_id, r.c.model_id, r.c.payload.is_(None))
    stmt = select(*columns).where(r.c.status == "pending")
    return [
        {"request_id": a, "kind": b, "tenant_id": c, "model_id": m, "no_payload": bool(d)}
        for a, b, c, m, d in conn.execute(stmt)
    ]


def record_snapshot(
    conn: Connection, model_id: str, seq_id: int, folder: str, samplers: dict[str, str]
) -> list[str]:
    """The model's new state snapshot, kept if its model is still loaded and it is newer than
    the recorded one; → the folders no row names any more, to delete: the snapshot replaced
    and its sampler folders the new one no longer names (its model dropped those samplers:
    their folders stay until now, as a crash before this commit restores the old one)."""
    t = StateSnapshotRow.__table__
    models = ModelRow.__table__
    status = conn.execute(select(models.c.status).where(models.c.model_id == model_id)).scalar()
    if status != "active":  # unloaded meanwhile (drop_states forgets what it had): no restore
        return [folder, *samplers.values()]
    old = conn.execute(select(t.c.seq_id, t.c.dir, t.c.samplers).where(t.c.model_id == model_id))
    old = old.first()
    if old is not None and old.seq_id > seq_id:
        return [folder]  # an older snapshot arrived late: it is the one to delete
    if old is not None and old.dir == folder:
        return []  # the same snapshot again
    values = {"seq_id": seq_id, "dir": folder, "samplers": samplers, "created_at": utcnow()}
    if old is None:
        conn.execute(insert(t), {"model_id": model_id, **values})
    else:
        conn.execute(update(t).where(t.c.model_id == model_id).values(values))
    r = REQUESTS
    conn.execute(
        update(r)
        .where((r.c.model_id == model_id) & (r.c.seq_id <= seq_id) & (r.c.status != "pending"))
        .values(payload=None)
    )
    if old is None:
        return []
    named = set(samplers.values())
    return [old.dir, *(f for f in (old.samplers or {}).values() if f not in named)]


def drop_states(conn: Connection, model_ids: list[str] | None = None) -> list[str]:
    """Forget the state snapshots of models no longer loaded (these, or every such model:
    None); → their folders, to delete."""
    t, models = StateSnapshotRow.__table__, ModelRow.__table__
    if model_ids is None:
        active = select(models.c.model_id).where(models.c.status == "active")
        which = t.c.model_id.not_in(active)
    else:
        which = t.c.model_id.in_(model_ids)
    folders = _named_folders(conn, which)
    conn.execute(delete(t).where(which))
    return folders


def snapshot_folders(conn: Connection) -> set[str]:
    """Every folder a recorded state snapshot names: state folders and sampler folders."""
    return set(_named_folders(conn, true()))


def _named_folders(conn: Connection, which: Any) -> list[str]:
    """The state and sampler folders the snapshot rows `which` selects name."""
    t = StateSnapshotRow.__table__
    rows = conn.execute(select(t.c.dir, t.c.samplers).where(which)).all()
    return [f for folder, samplers in rows for f in (folder, *(samplers or {}).values())]


def next_client(conn: Connection, sampling_session_id: str) -> int:
    """Count one more client of a sampling session; → its number (1, 2, ...)."""
    table = SamplingSessionRow.__table__
    where = table.c.sampling_session_id == sampling_session_id
    conn.execute(update(table).where(where).values(clients=table.c.clients + 1))
    return int(conn.execute(select(table.c.clients).where(where)).scalar_one())
