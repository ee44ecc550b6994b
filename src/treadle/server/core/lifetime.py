"""How long checkpoints live, and the storage each tenant holds.

- TTL: a checkpoint saved with `ttl_seconds` (or given one later, PUT .../ttl) expires then.
  The sweep (`expire_due`, every checkpoint_sweep_s) deletes an expired checkpoint's folder
  and marks its row expired (the row stays and says when; loading or sampling it is a 404
  that says it expired, listings leave it out). The model package versions published from
  it go with it, their files too (a server folder or S3 objects), unless their group has a
  retention rule (keep_last, state_ttl_s): then the rule keeps them, and deletes them in
  its time.
- Storage: the bytes of a tenant's live checkpoints and versions (`usage`), reported by
  billing/usage/checkpoints/current and capped by the max_storage_bytes quota: a save, an
  upload or a copy while the tenant holds that much is refused with a 403 naming the quota
  (`check_quota`).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import shutil
from dataclasses import dataclass

from sqlalchemy import func, select, update

from treadle.errors import NotFoundError, StorageQuotaError
from treadle.server.core.limits import Admission
from treadle.server.registry.versions import discard_versions
from treadle.server.storage.database import Store
from treadle.server.storage.rows import (
    CheckpointRow,
    ModelRow,
    PackageGroupRow,
    SessionRow,
    VersionRow,
    utcnow,
)
from treadle.server.tenancy.auth import Tenant

log = logging.getLogger("treadle.lifetime")


def aware(t: dt.datetime | None) -> dt.datetime | None:
    """SQLite hands datetimes back naive (they are UTC)."""
    return t if t is None or t.tzinfo else t.replace(tzinfo=dt.UTC)


def expires_at(ttl_seconds: int | None, now: dt.datetime | None = None) -> dt.datetime | None:
    if ttl_seconds is None:
        return None
    return (now or utcnow()) + dt.timedelta(seconds=ttl_seconds)


def check_live(row: CheckpointRow, field: str = "path") -> CheckpointRow:
    """The checkpoint, unless its files were deleted at its expiry (404 saying so)."""
    if row.expired_at is not None:
        when = aware(row.expired_at).isoformat(timespec="seconds")  # type: ignore[union-attr]
        raise NotFoundError(
            f"{field}: checkpoint {row.tinker_path!r} expired (its TTL ran out; its files were "
            f"deleted at {when})"
        )
    return row


def set_ttl(store: Store, row: CheckpointRow, ttl_seconds: int | None) -> dt.datetime | None:
    """A checkpoint's TTL from now (None: it never expires); → its new expiry."""
    check_live(row, "checkpoint_id")
    when = expires_at(ttl_seconds)
    with store.engine.begin() as conn:
        table = CheckpointRow.__table__
        conn.execute(
            update(table).where(table.c.tinker_path == row.tinker_path).values(expires_at=when)
        )
    return when


def expire_due(store: Store, now: dt.datetime | None = None) -> list[str]:
    """Delete the files of every checkpoint past its expiry, and the versions published
    from it in groups without a retention rule; mark its row expired. → their paths."""
    now = now or utcnow()
    table = CheckpointRow.__table__
    with store.engine.connect() as conn:
        due = conn.execute(
            select(table.c.tinker_path, table.c.tenant_id, table.c.dir).where(
                (table.c.expires_at <= now) & table.c.expired_at.is_(None)
            )
        ).all()
    done = []
    for path, tenant_id, folder in due:
        try:
            discard_versions(store, _versions_without_rule(store, tenant_id, path))
            shutil.rmtree(folder, ignore_errors=True)
            with store.engine.begin() as conn:
                conn.execute(
                    update(table)
                    .where(table.c.tinker_path == path)
                    .values(expired_at=now, size_bytes=0)
                )
            done.append(path)
            log.info("checkpoint %s expired: its files were deleted", path)
        except Exception:
            log.exception("could not expire checkpoint %s", path)
    return done


def _versions_without_rule(store: Store, tenant_id: str, path: str) -> list[VersionRow]:
    """The versions published from `path` whose group has no retention rule."""
    groups = PackageGroupRow.__table__
    ruled = select(groups.c.name).where(
        (groups.c.tenant_id == tenant_id)
        & (groups.c.keep_last.is_not(None) | groups.c.state_ttl_s.is_not(None))
    )
    return store.query(
        select(VersionRow).where(
            (VersionRow.tenant_id == tenant_id)
            & (VersionRow.tinker_path == path)
            & VersionRow.group_name.not_in(ruled)
        )
    )


@dataclass
class Usage:
    """Stored bytes of one tenant, by project (None: no project)."""

    project_id: str | None
    checkpoints: int
    size_bytes: int


def usage(store: Store, tenant_id: str, project_id: str | None = None) -> list[Usage]:
    """The tenant's live checkpoints and versions, by the project of the session that made
    them (`project_id`: that project's only)."""
    ck, models, sessions, versions = (
        CheckpointRow.__table__,
        ModelRow.__table__,
        SessionRow.__table__,
        VersionRow.__table__,
    )
    by_project: dict[str | None, Usage] = {}
    with store.engine.connect() as conn:
        project = func.coalesce(sessions.c.project_id, models.c.project_id)
        rows = conn.execute(
            select(project, func.count(), func.coalesce(func.sum(ck.c.size_bytes), 0))
            .select_from(
                ck.outerjoin(models, models.c.model_id == ck.c.model_id).outerjoin(
                    sessions, sessions.c.session_id == models.c.session_id
                )
            )
            .where((ck.c.tenant_id == tenant_id) & ck.c.expired_at.is_(None))
            .group_by(project)
        ).all()
        rows += conn.execute(
            select(
                sessions.c.project_id,
                func.count(),
                func.coalesce(func.sum(versions.c.size_bytes), 0),
            )
            .select_from(
                versions.outerjoin(sessions, sessions.c.session_id == versions.c.session_id)
            )
            .where(versions.c.tenant_id == tenant_id)
            .group_by(sessions.c.project_id)
        ).all()
    for project, count, size in rows:
        u = by_project.setdefault(project, Usage(project, 0, 0))
        u.checkpoints += int(count)
        u.size_bytes += int(size)
    found = sorted(by_project.values(), key=lambda u: u.project_id or "")
    return [u for u in found if project_id is None or u.project_id == project_id]


async def check_quota(store: Store, admission: Admission, tenant: Tenant) -> None:
    """Refuse a new checkpoint while the tenant holds its max_storage_bytes (403)."""
    quota = admission.quotas_of(tenant).max_storage_bytes
    if quota is None:
        return
    held = sum(u.size_bytes for u in await asyncio.to_thread(usage, store, tenant.tenant_id))
    if held >= quota:
        raise StorageQuotaError(
            f"quota max_storage_bytes ({quota}) exceeded: tenant {tenant.name!r} stores "
            f"{held} bytes of checkpoints; delete some, or give them a TTL, before saving more"
        )
