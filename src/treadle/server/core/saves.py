"""What a save wrote, committed with its result: the checkpoint's row, the sampling session a
snapshot made, and the model package versions whose files it stored.

The engine worker writes files and no rows (treadle.worker.checkpoints); its Outcome carries
these records, and Futures.finish commits them in the transaction of the result, before the
result is encoded: a client never learns of a checkpoint without its row, and a version is
numbered here, by the one API process, with its number in the result (`GROUP:N`). Each
group's retention then runs after the commit (`retain_after`), off the journal thread.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any

from sqlalchemy import Connection, select, update

from treadle.protocol.ops import Outcome, SaveResult
from treadle.server.core.lifetime import expires_at
from treadle.server.registry import versions
from treadle.server.storage.database import Store
from treadle.server.storage.queries import insert_row, insert_sampler_once
from treadle.server.storage.rows import CheckpointRow, utcnow

log = logging.getLogger("treadle.saves")


def commit_saved(conn: Connection, outcome: Outcome) -> None:
    """Insert a save's rows (on the journal's connection); the result gets its versions."""
    saved = outcome.saved
    assert saved is not None
    for ckpt in saved.checkpoints:
        values = dataclasses.asdict(ckpt)
        now = utcnow()
        ttl = values.pop("expires_in_s")
        values |= {"created_at": now, "expires_at": expires_at(ttl, now), "expired_at": None}
        _upsert_checkpoint(conn, values)
    for sampler in saved.samplers:
        insert_sampler_once(conn, dataclasses.asdict(sampler))
    refs = [f"{v.group_name}:{versions.insert_version(conn, v)}" for v in saved.versions]
    if refs and isinstance(outcome.result, SaveResult):
        outcome.result.versions = refs


def retain_after(store: Store, outcomes: list[Outcome]) -> None:
    """The retention of every group a version was just added to, on a thread of its own
    (it may delete files in an object store)."""
    groups = {
        (v.tenant_id, v.group_name)
        for o in outcomes
        if o.saved is not None and o.succeeded
        for v in o.saved.versions
    }
    if groups:
        threading.Thread(
            target=lambda: [versions.retain(store, t, g) for t, g in sorted(groups)],
            name="retention",
            daemon=True,
        ).start()


def _upsert_checkpoint(conn: Connection, values: dict[str, Any]) -> None:
    """A new checkpoint's row, or (a save with overwrite) the new files of its path."""
    table = CheckpointRow.__table__
    where = table.c.tinker_path == values["tinker_path"]
    if conn.execute(select(table.c.tinker_path).where(where)).first() is None:
        insert_row(conn, CheckpointRow, values)
        return
    changed = ("dir", "size_bytes", "user_metadata", "created_at", "expires_at", "expired_at")
    conn.execute(update(table).where(where).values({k: values[k] for k in changed}))
