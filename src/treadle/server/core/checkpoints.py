"""Saved checkpoints (tinker:// paths) and training runs: lookups and listings, all scoped
by the caller's tenant (another tenant's is the same 404 as a missing one), except that a
checkpoint its owner published is readable (sampled from, loaded, copied) by every tenant
of this server; only its owner lists, deletes, publishes or sets its TTL."""

from __future__ import annotations

import asyncio
import shutil

from sqlalchemy import select

from treadle.artifacts import folders as artifacts
from treadle.errors import NotFoundError
from treadle.server.core.lifetime import check_live
from treadle.server.storage.database import Store
from treadle.server.storage.rows import CheckpointRow, ModelRow, SessionRow
from treadle.server.tenancy.auth import owns


class Checkpoints:
    def __init__(self, store: Store):
        self.store = store

    async def get(self, path: str, field: str = "path") -> CheckpointRow:
        """The caller's checkpoint at a tinker:// path, or one another tenant published
        (read off the event loop); a checkpoint past its TTL is a 404 saying so."""
        artifacts.parse_tinker_path(path, field)
        row = await asyncio.to_thread(self.readable, path)
        if row is None:
            raise NotFoundError(f"{field}: checkpoint {path!r} not found")
        return check_live(row, field)

    def readable(self, path: str) -> CheckpointRow | None:
        """The caller's checkpoint at `path`, or a published one of any tenant."""
        row = self.store.get(CheckpointRow, path)
        if row is not None and owns(row.tenant_id):
            return row
        table = CheckpointRow.__table__  # Core: past the ORM's filter of the caller's rows
        with self.store.engine.connect() as conn:
            found = conn.execute(
                select(table).where((table.c.tinker_path == path) & table.c.public)
            ).first()
        return CheckpointRow(**found._mapping) if found is not None else None

    def of_run(self, run: ModelRow, checkpoint_id: str) -> CheckpointRow:
        """A run's checkpoint by its id ("weights/<name>", "sampler_weights/<name>", ...)."""
        path = f"tinker://{run.run_id}/{checkpoint_id}"
        artifacts.parse_tinker_path(path, "checkpoint_id")
        row = self.store.get(CheckpointRow, path)
        if row is None or not owns(row.tenant_id):
            raise NotFoundError(f"checkpoint {path!r} not found")
        return row

    def run_checkpoints(self, run: ModelRow) -> list[CheckpointRow]:
        """A run's live checkpoints, newest first."""
        return self.store.query(
            select(CheckpointRow)
            .where((CheckpointRow.run_id == run.run_id) & CheckpointRow.expired_at.is_(None))
            .order_by(CheckpointRow.created_at.desc())
        )

    def page(self, tenant_id: str, limit: int, offset: int) -> tuple[list[CheckpointRow], int]:
        """The tenant's checkpoints, newest first; → (this page, how many in all)."""
        stmt = (
            select(CheckpointRow)
            .where((CheckpointRow.tenant_id == tenant_id) & CheckpointRow.expired_at.is_(None))
            .order_by(CheckpointRow.created_at.desc())
        )
        return self.store.query(stmt.offset(offset).limit(limit)), self.store.count(stmt)

    def runs_page(
        self, tenant_id: str, limit: int, offset: int, project_id: str | None = None
    ) -> tuple[list[ModelRow], int]:
        """The tenant's training runs (one per training model), newest first; of one
        project's sessions (or copied into it) when `project_id` is given."""
        stmt = (
            select(ModelRow)
            .where(ModelRow.tenant_id == tenant_id)
            .order_by(ModelRow.created_at.desc())
        )
        if project_id is not None:
            in_project = select(SessionRow.session_id).where(SessionRow.project_id == project_id)
            stmt = stmt.where(
                ModelRow.session_id.in_(in_project) | (ModelRow.project_id == project_id)
            )
        return self.store.query(stmt.offset(offset).limit(limit)), self.store.count(stmt)

    def newest_sampler_checkpoints(self, tenant_id: str, limit: int) -> list[CheckpointRow]:
        return self.store.query(
            select(CheckpointRow)
            .where(
                (CheckpointRow.checkpoint_type == "sampler")
                & (CheckpointRow.tenant_id == tenant_id)
                & CheckpointRow.expired_at.is_(None)
            )
            .order_by(CheckpointRow.created_at.desc())
            .limit(limit)
        )

    def publish(self, row: CheckpointRow, public: bool) -> None:
        """Make the caller's checkpoint readable by every tenant of this server (or only by
        its own again)."""
        check_live(row, "checkpoint_id")
        with self.store.session.begin() as s:
            s.get(CheckpointRow, row.tinker_path).public = public

    def delete(self, row: CheckpointRow) -> None:
        """The checkpoint's files and row (versions published from it stay: they are copies
        in the group's store, deleted through the registry)."""
        with self.store.session.begin() as s:
            s.delete(s.get(CheckpointRow, row.tinker_path))
        shutil.rmtree(row.dir, ignore_errors=True)
