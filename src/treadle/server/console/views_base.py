"""What every read of the console shares: its tables, the views' state, and the scope rule.

The console's reads bypass the ORM's per-request tenant filter (see
treadle.server.console.views), so each statement filters on `scope` itself with _scoped;
ViewsBase holds what they all read from (the config, the Store, the engines, the
recorder's live figures, the spend book) and the tenant names they show. _version and the
_iso helpers shape rows the same way on every page.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import Connection, select

from treadle.server.config import ServerConfig
from treadle.server.console.recorder import Recorder
from treadle.server.engines.served import Engines
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
from treadle.server.tenancy.spend import SpendBook

S, M, R = SessionRow.__table__, ModelRow.__table__, RequestRow.__table__
OPS, F = OpRecordRow.__table__, StepFigureRow.__table__
C, G, V = CheckpointRow.__table__, PackageGroupRow.__table__, VersionRow.__table__


class ViewsBase:
    """The state every console view reads; the pages themselves are ConsoleViews's."""

    def __init__(
        self,
        config: ServerConfig,
        store: Store,
        engines: Engines,
        recorder: Recorder,
        spend: SpendBook,
    ):
        self.config = config
        self.store = store
        self.engines = engines
        self.recorder = recorder
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
