"""Spend caps: the tokens and/or dollars a tenant, or one of its API keys, may spend per UTC
day or calendar month (UTC), enforced before every metered operation.

A cap is a row of `spend_caps` (`treadle admin set-spend-cap`): a tenant-wide cap counts
every operation of the tenant, a key's cap only those sent with that key. Tokens are the
three metered counters summed (prefill + sample + train, treadle.server.tenancy.metering);
dollars come from the config's price table, so a model without a price costs $0.

The SpendBook keeps what each tenant and key spent in the current day and month in memory:
a baseline read once at start-up from the requests table (before any engine runs, so
nothing is counted twice), then every successful operation as its result is committed,
charged from its own request's tenant, key and served model by the spend listener
(treadle.server.tenancy.spend_listener), whether or not the console runs.
Caps are re-read from the database at most once a second, so a cap set while the server
runs applies within a second.

Over a cap, forward, forward_backward and sample requests get a 429 whose message starts
with "spend cap", names the cap, its value, what was spent and when it resets, with
`x-should-retry: false` (waiting seconds cannot help; a loop stops with the error).
Saves, optimizer steps and everything else that costs no tokens still pass, so a loop can
still save its work. A cap is checked before an operation runs: operations already in
flight finish, so spend can pass a cap by what was in flight when it was reached.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, delete, func, or_, select

from treadle.errors import InvalidRequestError, NotFoundError, QuotaExceededError
from treadle.server.config import Price
from treadle.server.storage.database import Store
from treadle.server.storage.rows import (
    ApiKeyRow,
    RequestRow,
    SpendCapRow,
    TenantRow,
    new_id,
    utcnow,
)
from treadle.server.tenancy.auth import Tenant, hash_key, key_id
from treadle.server.tenancy.metering import COLUMN_OF, COUNTERS, cost_usd, metered

PERIODS = ("day", "month")
CAP_RELOAD_S = 1.0
TENANT_SCOPE = "tenant"


def key_scope(kid: str) -> str:
    return f"key:{kid}"


# ---- periods ----
def period_bounds(period: str, now: dt.datetime) -> tuple[dt.datetime, dt.datetime]:
    """[start, end) of the UTC day or calendar month holding `now`."""
    now = now.astimezone(dt.UTC)
    if period == "day":
        start = now.replace(hour=0, minute=0, second=0, microsecond=0)
        return start, start + dt.timedelta(days=1)
    if period == "month":
        start = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
        end = start.replace(year=start.year + 1, month=1) if start.month == 12 else None
        return start, end or start.replace(month=start.month + 1)
    raise InvalidRequestError(f"period: expected one of {list(PERIODS)}, got {period!r}")


@dataclass(frozen=True)
class Cap:
    tenant_id: str
    scope: str  # tenant | key:<key_id>
    period: str  # day | month
    max_tokens: int | None
    max_usd: float | None

    @property
    def names(self) -> list[str]:
        out = [f"tokens_per_{self.period}"] if self.max_tokens is not None else []
        return out + ([f"usd_per_{self.period}"] if self.max_usd is not None else [])


@dataclass
class Spent:
    start: float  # the period's start (epoch seconds)
    tokens: int = 0
    usd: float = 0.0


class SpendBook:
    """What each tenant and key spent this day and month, and the caps on it."""

    def __init__(self, engine: Engine, prices: dict[str, Price]):
        self.engine = engine
        self.prices = prices
        self._lock = threading.Lock()
        self._spent: dict[tuple[str, str, str], Spent] = {}  # (tenant_id, scope, period)
        self._caps: list[Cap] = []
        self._caps_read_at = float("-inf")

    # ---- counting ----
    def load(self) -> None:
        """The baseline: what was spent this day and month before this process started
        (each finished request's row names its tenant, key and served model). Call before
        engines run."""
        now = utcnow()
        r = RequestRow.__table__
        sums = [func.coalesce(func.sum(r.c[COLUMN_OF[c]]), 0) for c in COUNTERS]
        with self._lock, self.engine.connect() as conn:
            self._spent.clear()
            for period in PERIODS:
                start, _ = period_bounds(period, now)
                rows = conn.execute(
                    select(r.c.tenant_id, r.c.key_id, r.c.base_model, *sums)
                    .where(metered(r) & (r.c.finished_at >= start))
                    .group_by(r.c.tenant_id, r.c.key_id, r.c.base_model)
                ).all()
                for tid, kid, base_model, *counts in rows:
                    at = start.timestamp()
                    self._add_locked(tid, TENANT_SCOPE, period, at, base_model, counts)
                    if kid is not None:
                        self._add_locked(tid, key_scope(kid), period, at, base_model, counts)

    def add(
        self,
        tenant_id: str,
        kid: str | None,
        base_model: str | None,
        counts: tuple[int, ...],
        when: float,
    ) -> None:
        """Count one successful operation's tokens (metering.COUNTERS), finished at
        `when` (epoch seconds), for its tenant and its key (any thread)."""
        if not any(counts):
            return
        at = dt.datetime.fromtimestamp(when, dt.UTC)
        with self._lock:
            for period in PERIODS:
                start = period_bounds(period, at)[0].timestamp()
                self._add_locked(tenant_id, TENANT_SCOPE, period, start, base_model, counts)
                if kid is not None:
                    self._add_locked(tenant_id, key_scope(kid), period, start, base_model, counts)

    def _add_locked(
        self,
        tenant_id: str,
        scope: str,
        period: str,
        start: float,
        base_model: str | None,
        counts: Any,
    ) -> None:
        usage = dict.fromkeys(COUNTERS, 0)  # counts may end before the later counters
        usage.update(zip(COUNTERS, (int(c) for c in counts), strict=False))
        slot = self._spent.get((tenant_id, scope, period))
        if slot is None or slot.start < start:  # a new period begins at zero
            slot = self._spent[(tenant_id, scope, period)] = Spent(start)
        elif slot.start > start:
            return  # a late result of the previous period
        slot.tokens += sum(usage.values())
        slot.usd += cost_usd(usage, self.prices.get(base_model or ""))

    def spent(self, tenant_id: str, scope: str, period: str) -> Spent:
        start = period_bounds(period, utcnow())[0].timestamp()
        with self._lock:
            slot = self._spent.get((tenant_id, scope, period))
            if slot is None or slot.start < start:
                return Spent(start)
            return Spent(slot.start, slot.tokens, slot.usd)

    # ---- caps ----
    def caps(self) -> list[Cap]:
        if time.monotonic() - self._caps_read_at > CAP_RELOAD_S:
            t = SpendCapRow.__table__
            with self.engine.connect() as conn:
                rows = conn.execute(
                    select(t.c.tenant_id, t.c.scope, t.c.period, t.c.max_tokens, t.c.max_usd)
                ).all()
            self._caps = [Cap(*row) for row in rows]
            self._caps_read_at = time.monotonic()
        return self._caps

    def check(self, tenant: Tenant, kid: str | None) -> None:
        """QuotaExceededError (429, no retry) if a cap of the tenant or of its key is
        reached."""
        for cap in self.caps():
            if cap.tenant_id != tenant.tenant_id:
                continue
            if cap.scope != TENANT_SCOPE and (kid is None or cap.scope != key_scope(kid)):
                continue
            spent = self.spent(tenant.tenant_id, cap.scope, cap.period)
            if cap.max_tokens is not None and spent.tokens >= cap.max_tokens:
                raise _over(
                    cap,
                    tenant,
                    f"tokens_per_{cap.period}",
                    f"{cap.max_tokens} tokens",
                    f"{spent.tokens} tokens",
                    spent,
                )
            if cap.max_usd is not None and spent.usd >= cap.max_usd:
                raise _over(
                    cap,
                    tenant,
                    f"usd_per_{cap.period}",
                    f"${cap.max_usd:g}",
                    f"${spent.usd:.6f}",
                    spent,
                )

    def report(self, tenant_id: str | None) -> list[dict[str, Any]]:
        """Every cap of one tenant (or all) with what was spent under it so far."""
        out = []
        for cap in self.caps():
            if tenant_id is not None and cap.tenant_id != tenant_id:
                continue
            spent = self.spent(cap.tenant_id, cap.scope, cap.period)
            start = dt.datetime.fromtimestamp(spent.start, dt.UTC)
            out.append(
                {
                    "tenant_id": cap.tenant_id,
                    "scope": cap.scope,
                    "period": cap.period,
                    "max_tokens": cap.max_tokens,
                    "max_usd": cap.max_usd,
                    "spent_tokens": spent.tokens,
                    "spent_usd": round(spent.usd, 9),
                    "since": start.isoformat(),
                    "resets_at": period_bounds(cap.period, start)[1].isoformat(),
                }
            )
        return sorted(out, key=lambda c: (c["tenant_id"], c["scope"], c["period"]))


def _over(
    cap: Cap, tenant: Tenant, name: str, limit: str, spent: str, slot: Spent
) -> QuotaExceededError:
    start = dt.datetime.fromtimestamp(slot.start, dt.UTC)
    end = period_bounds(cap.period, start)[1]
    who = f"tenant {tenant.name!r}"
    if cap.scope != TENANT_SCOPE:
        who = f"key {cap.scope.removeprefix('key:')}... of {who}"
    return QuotaExceededError(
        f"spend cap {name} ({limit}) of {who} reached: {spent} spent since "
        f"{start:%Y-%m-%d %H:%M} UTC; it resets at {end:%Y-%m-%d %H:%M} UTC "
        "(raise it with `treadle admin set-spend-cap`)",
        None,
    )


# ---- `treadle admin set-spend-cap` (the database, server up or down) ----
def set_cap(
    store: Store,
    tenant: str,
    period: str,
    max_tokens: int | None = None,
    max_usd: float | None = None,
    key: str | None = None,
) -> dict[str, Any] | None:
    """Set a cap of a tenant (or of one of its keys: the key or its id); None leaves a
    limit as it is, 0 clears it. → the cap as stored, or None when nothing is left of it."""
    from treadle.server.tenancy.tenants import find_tenant

    period_bounds(period, utcnow())  # validates the period
    if max_tokens is None and max_usd is None:
        raise InvalidRequestError("spend cap: give tokens or usd (0 clears one)")
    for name, value in (("tokens", max_tokens), ("usd", max_usd)):
        if value is not None and value < 0:
            raise InvalidRequestError(f"{name}: expected >= 0 (0 clears the cap), got {value}")
    owner = find_tenant(store, tenant)
    scope = TENANT_SCOPE
    if key is not None:
        keys = store.query(
            select(ApiKeyRow).where(
                or_(ApiKeyRow.key_hash == hash_key(key), ApiKeyRow.key_id == key)
            )
        )
        if not keys or keys[0].tenant_id != owner.tenant_id:
            raise NotFoundError(f"API key {key_id(key)!r} of tenant {owner.name!r} not found")
        scope = key_scope(keys[0].key_id)
    where = (
        (SpendCapRow.tenant_id == owner.tenant_id)
        & (SpendCapRow.scope == scope)
        & (SpendCapRow.period == period)
    )
    with store.session.begin() as s:
        row = s.scalars(select(SpendCapRow).where(where)).first()
        if row is None:
            row = SpendCapRow(id=new_id(), tenant_id=owner.tenant_id, scope=scope, period=period)
            s.add(row)
        if max_tokens is not None:
            row.max_tokens = max_tokens or None
        if max_usd is not None:
            row.max_usd = max_usd or None
        if row.max_tokens is None and row.max_usd is None:
            s.execute(delete(SpendCapRow).where(where))
            return None
        return _cap_view(row, owner.name)


def list_caps(store: Store) -> list[dict[str, Any]]:
    names = {t.tenant_id: t.name for t in store.query(select(TenantRow))}
    rows = store.query(select(SpendCapRow).order_by(SpendCapRow.tenant_id, SpendCapRow.scope))
    return [_cap_view(r, names.get(r.tenant_id, r.tenant_id)) for r in rows]


def _cap_view(row: SpendCapRow, tenant_name: str) -> dict[str, Any]:
    return {
        "tenant": tenant_name,
        "scope": row.scope,
        "period": row.period,
        "max_tokens": row.max_tokens,
        "max_usd": row.max_usd,
    }
