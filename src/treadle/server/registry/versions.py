"""Model package groups: every save of a session bound to a group becomes a numbered version.

A training model created with `model_package_group="name"` (and optionally `output_path`,
an s3:// prefix or a server folder) is bound to that group; each of its saves then
publishes a version: the files are stored first, by whoever wrote them (the engine worker for
a save, treadle.artifacts.packages: a temp folder renamed into place, or S3 objects with the
manifest last), and the row is inserted after, by the API (with the save's result), so a
version in the table is always complete. A failed store registers nothing.

Kinds: `sampler` (a PEFT adapter: named sampler saves and the per-step sampler refresh),
`merged` (a full HF model folder, from save_weights_for_sampler(merge_weights=True)) and
`state` (adapter + optimizer: save_state). Version references are `GROUP:N` or
`GROUP:latest` (treadle.server.registry.names). Every query is scoped by tenant_id: another
tenant's group is not found.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import shutil
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, delete, func, select

from treadle.artifacts import stores
from treadle.artifacts.packages import discard_version, store_version
from treadle.errors import InvalidRequestError, NotFoundError
from treadle.protocol.ops import PackageTarget
from treadle.protocol.saved import VersionRecord
from treadle.server.registry.names import parse_ref
from treadle.server.storage.database import Store
from treadle.server.storage.rows import (
    CheckpointRow,
    PackageGroupRow,
    VersionRow,
    new_id,
    utcnow,
)

log = logging.getLogger("treadle.registry")

KINDS = ("sampler", "merged", "state")


def version_view(row: VersionRow) -> dict[str, Any]:
    return {
        "group": row.group_name,
        "version": row.version,
        "ref": f"{row.group_name}:{row.version}",
        "kind": row.kind,
        "name": row.name,
        "session_id": row.session_id,
        "model_id": row.model_id,
        "training_run_id": row.run_id,
        "base_model": row.base_model,
        "lora_config": row.lora_config,
        "step": row.step,
        "time": row.created_at.isoformat(),
        "size_bytes": row.size_bytes,
        "user_metadata": row.user_metadata,
        "path": row.location,
        "tinker_path": row.tinker_path,
        "encrypted": row.encrypted,
        "key_id": row.key_id,
        "source": row.source,
    }


# ---- publishing ----
def publish(
    db: Store,
    pkg: PackageTarget,
    kind: str,
    src_dir: Path,
    *,
    name: str | None = None,
    tinker_path: str | None = None,
    step: int | None = None,
    user_metadata: dict | None = None,
    source: str | None = None,
    store: stores.ArtifactStore | None = None,
) -> VersionRow:
    """Store src_dir's files, then register the version (the API's own saves: imports);
    nothing is registered if storing fails, and the files go if registering does. Applies
    the group's retention afterwards."""
    assert kind in KINDS, kind
    record = store_version(
        pkg, kind, src_dir, name=name, tinker_path=tinker_path, step=step,
        user_metadata=user_metadata, source=source, store=store,
    )  # fmt: skip
    try:
        with db.engine.begin() as conn:
            number = insert_version(conn, record)
    except BaseException:
        discard_version(record)
        raise
    retain(db, pkg.tenant_id, pkg.group)
    return get_version(db, pkg.tenant_id, f"{pkg.group}:{number}")


def insert_version(conn: Connection, record: VersionRecord) -> int:
    """Register a stored version as the next number of its group (made if new); → the
    number. One API process writes versions, through one connection at a time."""
    groups, versions = PackageGroupRow.__table__, VersionRow.__table__
    tenant, group = record.tenant_id, record.group_name
    in_group = (groups.c.tenant_id == tenant) & (groups.c.name == group)
    if conn.execute(select(groups.c.id).where(in_group)).first() is None:
        values = {"id": new_id(), "tenant_id": tenant, "name": group, "created_at": utcnow()}
        conn.execute(groups.insert().values(values))
    last = conn.execute(
        select(func.max(versions.c.version)).where(
            (versions.c.tenant_id == tenant) & (versions.c.group_name == group)
        )
    ).scalar()
    number = (last or 0) + 1
    row = {**dataclasses.asdict(record), "id": new_id(), "version": number, "created_at": utcnow()}
    conn.execute(versions.insert().values(row))
    return number


def retain(db: Store, tenant_id: str, group: str) -> None:
    """Apply the group's retention after a version was added (a failure is logged: the
    version is complete and registered, the save succeeded)."""
    try:
        apply_retention(db, tenant_id, group)
    except Exception:
        log.exception("retention of group %s (tenant %s) failed", group, tenant_id)


# ---- queries (all scoped by tenant) ----
def list_groups(db: Store, tenant_id: str) -> list[dict[str, Any]]:
    groups = db.query(
        select(PackageGroupRow)
        .where(PackageGroupRow.tenant_id == tenant_id)
        .order_by(PackageGroupRow.name)
    )
    out = []
    for g in groups:
        versions = _versions(db, tenant_id, g.name)
        out.append(
            {
                "name": g.name,
                "versions": len(versions),
                "latest": versions[-1].version if versions else None,
                "size_bytes": sum(v.size_bytes for v in versions),
                "keep_last": g.keep_last,
                "state_ttl_s": g.state_ttl_s,
                "created_at": g.created_at.isoformat(),
            }
        )
    return out


def _group(db: Store, tenant_id: str, group: str) -> PackageGroupRow:
    rows = db.query(
        select(PackageGroupRow).where(
            (PackageGroupRow.tenant_id == tenant_id) & (PackageGroupRow.name == group)
        )
    )
    if not rows:
        raise NotFoundError(f"model package group {group!r} not found")
    return rows[0]


def _versions(
    db: Store, tenant_id: str, group: str, kinds: tuple[str, ...] | None = None
) -> list[VersionRow]:
    stmt = select(VersionRow).where(
        (VersionRow.tenant_id == tenant_id) & (VersionRow.group_name == group)
    )
    if kinds:
        stmt = stmt.where(VersionRow.kind.in_(kinds))
    return db.query(stmt.order_by(VersionRow.version))


def list_versions(
    db: Store, tenant_id: str, group: str, kind: str | None = None
) -> list[VersionRow]:
    if kind is not None and kind not in KINDS:
        raise InvalidRequestError(f"kind: expected one of {KINDS}, got {kind!r}")
    apply_retention(db, tenant_id, group)  # a state past its TTL is never listed
    return _versions(db, tenant_id, group, (kind,) if kind else None)


def get_version(
    db: Store, tenant_id: str, ref: str, kinds: tuple[str, ...] | None = None
) -> VersionRow:
    """A version by `GROUP:N` / `GROUP:latest` (latest of `kinds` when given)."""
    group, number = parse_ref(ref)
    versions = _versions(db, tenant_id, group, kinds if number is None else None)
    if number is None:
        if not versions:
            what = f" of kind {'/'.join(kinds)}" if kinds else ""
            raise NotFoundError(f"version {ref!r}: group {group!r} has no versions{what}")
        return versions[-1]
    found = [v for v in versions if v.version == number]
    if not found:
        raise NotFoundError(f"version {ref!r} not found")
    if kinds and found[0].kind not in kinds:
        raise InvalidRequestError(
            f"version {ref!r} is a {found[0].kind} version; expected {'/'.join(kinds)}"
        )
    return found[0]


def version_by_tinker_path(db: Store, tenant_id: str, path: str) -> VersionRow | None:
    rows = db.query(
        select(VersionRow)
        .where((VersionRow.tenant_id == tenant_id) & (VersionRow.tinker_path == path))
        .order_by(VersionRow.created_at.desc())
    )
    return rows[0] if rows else None


# ---- deletion and retention ----
def delete_version(db: Store, tenant_id: str, ref: str) -> VersionRow:
    row = get_version(db, tenant_id, ref)
    _delete_rows(db, [row])
    return row


def _delete_rows(db: Store, rows: list[VersionRow]) -> None:
    """Rows first (a version never points to missing files), then files. The checkpoint a
    version was published from goes too (they are one artifact), unless a version that
    stays was published under the same tinker path (a save with overwrite)."""
    if not rows:
        return
    with db.session.begin() as s:
        s.execute(delete(VersionRow).where(VersionRow.id.in_([r.id for r in rows])))
        for path in {r.tinker_path for r in rows if r.tinker_path}:
            if s.scalar(select(VersionRow.id).where(VersionRow.tinker_path == path).limit(1)):
                continue
            ckpt = s.get(CheckpointRow, path)
            if ckpt is not None:
                shutil.rmtree(ckpt.dir, ignore_errors=True)
                s.delete(ckpt)
    _delete_files(rows)


def discard_versions(db: Store, rows: list[VersionRow]) -> None:
    """Delete these versions, rows then files (a folder, or S3 objects), leaving the
    checkpoints they were published from as they are (an expiring checkpoint takes the
    versions of groups without a retention rule with it: treadle.server.core.lifetime)."""
    if not rows:
        return
    with db.session.begin() as s:
        s.execute(delete(VersionRow).where(VersionRow.id.in_([r.id for r in rows])))
    _delete_files(rows)


def _delete_files(rows: list[VersionRow]) -> None:
    for r in rows:
        try:
            stores.open_location(r.location).delete_all()
        except Exception:  # noqa: BLE001 - the row is gone; a leftover object is only space
            log.warning("could not delete the files of version %s:%s", r.group_name, r.version)


def set_retention(
    db: Store,
    tenant_id: str,
    group: str,
    keep_last: int | None = None,
    state_ttl_s: float | None = None,
) -> list[VersionRow]:
    """Set the group's policy and apply it now; → the versions deleted."""
    if keep_last is not None and keep_last < 1:
        raise InvalidRequestError(f"keep_last: expected >= 1 or null, got {keep_last}")
    if state_ttl_s is not None and state_ttl_s <= 0:
        raise InvalidRequestError(f"state_ttl_s: expected > 0 or null, got {state_ttl_s}")
    row = _group(db, tenant_id, group)
    db.set(PackageGroupRow, row.id, keep_last=keep_last, state_ttl_s=state_ttl_s)
    return apply_retention(db, tenant_id, group)


def expired_versions(
    versions: list[VersionRow],
    keep_last: int | None,
    state_ttl_s: float | None,
    now: dt.datetime,
) -> list[VersionRow]:
    """The policy itself: of each sampler kind only the newest `keep_last` stay; states
    older than the TTL go. `versions` are in version order."""
    doomed = []
    if keep_last is not None:
        for kind in ("sampler", "merged"):
            of_kind = [v for v in versions if v.kind == kind]
            doomed += of_kind[: max(0, len(of_kind) - keep_last)]
    if state_ttl_s is not None:
        cutoff = now - dt.timedelta(seconds=state_ttl_s)
        doomed += [v for v in versions if v.kind == "state" and _aware(v.created_at) < cutoff]
    return sorted(doomed, key=lambda v: v.version)


def _aware(t: dt.datetime) -> dt.datetime:
    # SQLite hands datetimes back naive (in UTC)
    return t if t.tzinfo else t.replace(tzinfo=dt.UTC)


def apply_retention(db: Store, tenant_id: str, group: str) -> list[VersionRow]:
    g = _group(db, tenant_id, group)
    if g.keep_last is None and g.state_ttl_s is None:
        return []
    doomed = expired_versions(_versions(db, tenant_id, group), g.keep_last, g.state_ttl_s, utcnow())
    _delete_rows(db, doomed)
    return doomed
