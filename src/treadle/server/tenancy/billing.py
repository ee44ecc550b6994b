"""Billing answers in the tinker SDK's shapes, from Treadle's metering and price table
(treadle.server.tenancy.metering): GET /api/v1/billing/usage/events (hourly buckets of a
tenant's metered tokens and new checkpoints, per session and served model, priced at the
configured $ per million tokens) and the audit log (GET /api/v1/audit: the tenant's keys,
sessions and checkpoints, as events).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import Engine, select

from treadle.errors import InvalidRequestError
from treadle.server.config import Price
from treadle.server.storage.rows import ApiKeyRow, CheckpointRow, RequestRow, SessionRow
from treadle.server.tenancy.metering import metered

MAX_WINDOW = dt.timedelta(days=14)
# usage kind → (request column, the price's rate); the cached prefill is a sampling_prefill
# event with cached true
TOKEN_KINDS = {
    "training": ("train_tokens", "train"),
    "sampling_prefill": ("prompt_tokens", "prefill"),
    "sampling_sample": ("sampled_tokens", "sample"),
    "sampling_prefill_cached": ("cached_prompt_tokens", "cached_prefill_rate"),
}


def check_window(start: dt.datetime, end: dt.datetime) -> None:
    """The SDK's rules: hour-aligned UTC bounds, start not in the future, at most 14 days."""
    for name, t in (("starting_on", start), ("ending_before", end)):
        if t.minute or t.second or t.microsecond:
            raise InvalidRequestError(f"{name}: align it to a UTC hour, got {t.isoformat()}")
    if start > dt.datetime.now(dt.UTC):
        raise InvalidRequestError(f"starting_on: {start.isoformat()} is in the future")
    if not start < end <= start + MAX_WINDOW:
        raise InvalidRequestError(
            "ending_before: expected after starting_on and at most 14 days after it"
        )


def usage_events(
    engine: Engine, prices: dict[str, Price], tenant_id: str, start: dt.datetime, end: dt.datetime
) -> dict[str, Any]:
    """A BillingUsageResponse: hourly buckets by (session, model, kind)."""
    check_window(start, end)
    r, c = RequestRow.__table__, CheckpointRow.__table__
    buckets: dict[tuple, int] = {}
    with engine.connect() as conn:
        rows = conn.execute(
            select(
                r.c.session_id,
                r.c.base_model,
                r.c.finished_at,
                r.c.train_tokens,
                r.c.prompt_tokens,
                r.c.sampled_tokens,
                r.c.cached_prompt_tokens,
            ).where(  # fmt: skip
                (r.c.tenant_id == tenant_id)
                & metered(r)
                & (r.c.finished_at >= start)
                & (r.c.finished_at < end)
            )
        ).all()
        for session_id, base_model, at, *tokens in rows:
            hour = _hour(at)
            for kind, count in zip(TOKEN_KINDS, tokens, strict=True):
                if count:
                    key = (hour, session_id, base_model, kind)
                    buckets[key] = buckets.get(key, 0) + int(count)
        saved = conn.execute(
            select(c.c.created_at, c.c.base_model).where(
                (c.c.tenant_id == tenant_id) & (c.c.created_at >= start) & (c.c.created_at < end)
            )
        ).all()
        for at, base_model in saved:
            key = (_hour(at), None, base_model, "checkpoint")
            buckets[key] = buckets.get(key, 0) + 1
        session_ids = sorted({k[1] for k in buckets if k[1]})
        s = SessionRow.__table__
        info = {
            sid: (project, metadata)
            for sid, project, metadata in conn.execute(
                select(s.c.session_id, s.c.project_id, s.c.user_metadata).where(
                    s.c.session_id.in_(session_ids)
                )
            )
        }
    data = []
    for (hour, sid, base_model, kind), count in sorted(buckets.items(), key=_order):
        event: dict[str, Any] = {
            "bucket_start": hour,
            "bucket_end": hour + dt.timedelta(hours=1),
            "base_model": base_model,
            "user_id": f"treadle:tenant:{tenant_id}",
            "session_id": sid,
            "project_id": info.get(sid, (None, None))[0],
        }
        if kind == "checkpoint":
            event["event_info"] = {"type": "checkpoint", "count": count}
        else:
            cached = kind == "sampling_prefill_cached"
            info_ = {"type": "sampling_prefill" if cached else kind, "token_count": count}
            if kind.startswith("sampling_prefill"):
                info_["cached"] = cached
            price = prices.get(base_model or "")
            rate = getattr(price, TOKEN_KINDS[kind][1]) if price is not None else None
            event["event_info"] = info_
            event["effective_rate_usd_per_million_tokens"] = rate
            event["estimated_cost_usd"] = None if rate is None else rate * count / 1e6
        data.append(event)
    sessions = {
        sid: {"user_metadata": {k: str(v) for k, v in (md or {}).items()} or None}
        for sid, (_, md) in info.items()
    }
    return {"data": data, "sessions": sessions, "cost_data_through": None}


def _order(item: tuple) -> tuple:
    (hour, _, _, _), count = item
    return (hour, -count)


def _hour(when: dt.datetime) -> dt.datetime:
    when = when if when.tzinfo else when.replace(tzinfo=dt.UTC)
    return when.replace(minute=0, second=0, microsecond=0)


# ---- the audit log -------------------------------------------------------------------------
AUDIT_KINDS = ("all", "checkpoints", "projects", "teams", "organizations")


def audit_log(
    engine: Engine, tenant_id: str, event_type: str, day: dt.date | None
) -> dict[str, Any]:
    """AuditLogResponse entries of the tenant: its keys made and revoked (organizations:
    a tenant is its own organization), its sessions started and ended (projects), its
    checkpoints saved and expired (checkpoints); no teams here. Oldest first."""
    if event_type not in AUDIT_KINDS:
        raise InvalidRequestError(f"event_type: expected one of {list(AUDIT_KINDS)}")
    entries: list[dict[str, Any]] = []
    k, s, c = ApiKeyRow.__table__, SessionRow.__table__, CheckpointRow.__table__
    with engine.connect() as conn:
        if event_type in ("all", "organizations"):
            for kid, made, revoked in conn.execute(
                select(k.c.key_id, k.c.created_at, k.c.revoked_at).where(k.c.tenant_id == tenant_id)
            ):
                entries.append(_entry(made, "api_key_created", {"key_id": kid}))
                if revoked is not None:
                    entries.append(_entry(revoked, "api_key_revoked", {"key_id": kid}))
        if event_type in ("all", "projects"):
            for sid, project, status, made, ended in conn.execute(
                select(
                    s.c.session_id, s.c.project_id, s.c.status, s.c.created_at, s.c.ended_at
                ).where(s.c.tenant_id == tenant_id)
            ):
                details = {"session_id": sid, "project_id": project}
                entries.append(_entry(made, "session_created", details))
                if ended is not None:
                    entries.append(_entry(ended, f"session_{status}", details))
        if event_type in ("all", "checkpoints"):
            for path, model_id, made, expired in conn.execute(
                select(c.c.tinker_path, c.c.model_id, c.c.created_at, c.c.expired_at).where(
                    c.c.tenant_id == tenant_id
                )
            ):
                details = {"tinker_path": path, "model_id": model_id}
                entries.append(_entry(made, "checkpoint_created", details, path, model_id))
                if expired is not None:
                    entries.append(_entry(expired, "checkpoint_expired", details, path, model_id))
    if day is not None:
        entries = [e for e in entries if e["timestamp"].date() == day]
    return {"entries": sorted(entries, key=lambda e: e["timestamp"])}


def _entry(
    when: dt.datetime,
    event: str,
    details: dict[str, Any],
    tinker_path: str | None = None,
    model_id: str | None = None,
) -> dict[str, Any]:
    when = when if when.tzinfo else when.replace(tzinfo=dt.UTC)
    return {
        "timestamp": when,
        "event": event,
        "event_details": details,
        "tinker_path": tinker_path,
        "model_id": model_id,
    }
