"""The account routes of the tinker SDK (AdminClient, `tinker auth`, the pjwt exchange), with
Treadle's meaning: a tenant is its own organization, and every answer is the caller's
tenant's.

    GET    billing/usage/events?starting_on=&ending_before=   hourly metered usage, priced
    GET    billing/usage/checkpoints/current?project_id=     stored bytes now, by project
    GET    audit?event_type=&day=                             keys, sessions, checkpoints
    GET    auth/apikey/me                                     the presented key's metadata
    DELETE auth/apikey/me                                     revoke the presented key
    POST   auth/token                                         the key → a short-lived token
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
from typing import Any

from fastapi import APIRouter, Request

from treadle.errors import InvalidRequestError
from treadle.server.api.deps import StateDep, TenantDep
from treadle.server.core import lifetime
from treadle.server.tenancy import billing, tenants
from treadle.server.tenancy.auth import DEV_TENANT, hash_key, key_id, request_key
from treadle.server.tenancy.tokens import TokenIssuer, is_token

router = APIRouter(prefix="/api/v1")
GB = 1e9  # the storage billing unit


@router.get("/billing/usage/events")
def billing_usage_events(
    state: StateDep,
    tenant: TenantDep,
    starting_on: dt.datetime | None = None,
    ending_before: dt.datetime | None = None,
) -> dict[str, Any]:
    """The tenant's metered tokens and new checkpoints in hourly buckets (at most 14 days),
    per session and served model, priced from the server's price table (without a window:
    the last day, to the end of this hour)."""
    end = dt.datetime.now(dt.UTC).replace(minute=0, second=0, microsecond=0)
    end += dt.timedelta(hours=1)
    if ending_before is not None:
        end = _utc(ending_before, "ending_before")
    start = end - dt.timedelta(days=1)
    if starting_on is not None:
        start = _utc(starting_on, "starting_on")
    return billing.usage_events(
        state.store.engine, state.config.prices, tenant.tenant_id, start, end
    )


@router.get("/billing/usage/checkpoints/current")
def checkpoint_storage_now(
    state: StateDep, tenant: TenantDep, project_id: str | None = None
) -> dict[str, Any]:
    """The bytes of the tenant's live checkpoints and versions now, by project, and what a
    month of them costs at the server's storage_price."""
    rate = state.config.storage_price or None
    data = []
    for u in lifetime.usage(state.store, tenant.tenant_id, project_id):
        gigabytes = u.size_bytes / GB
        data.append(
            {
                "project_id": u.project_id,
                "org_user_urn": f"treadle:tenant:{tenant.tenant_id}",
                "user_name": tenant.name,
                "checkpoint_count": u.checkpoints,
                "size_bytes": u.size_bytes,
                "size_gigabytes": gigabytes,
                "estimated_monthly_cost_usd": None if rate is None else gigabytes * rate,
            }
        )
    return {"effective_rate_usd_per_gigabyte_month": rate, "data": data}


@router.get("/audit")
def audit(
    state: StateDep, tenant: TenantDep, event_type: str = "all", day: dt.date | None = None
) -> dict[str, Any]:
    """The tenant's events: keys made and revoked, sessions started and ended, checkpoints
    saved and expired."""
    return billing.audit_log(state.store.engine, tenant.tenant_id, event_type, day)


@router.get("/auth/apikey/me")
def api_key_me(request: Request, tenant: TenantDep) -> dict[str, Any]:
    """The presented key's public metadata (what `tinker auth login` checks)."""
    kid = key_id(request_key(request.scope["headers"]) or "") or "none"
    return {
        "key_id": int(hashlib.sha256(kid.encode()).hexdigest()[:12], 16),
        "name": kid,
        "note": f"an API key of tenant {tenant.name!r}",
        "details": {
            "org_details": {"name": tenant.name},
            "user_details": {"email": ""},
        },
    }


@router.delete("/auth/apikey/me")
async def revoke_api_key_me(request: Request, state: StateDep, tenant: TenantDep) -> dict:
    """Revoke the presented key itself (`tinker auth logout`), and no other."""
    key = request_key(request.scope["headers"])
    if tenant == DEV_TENANT or not key or is_token(key):
        raise InvalidRequestError(
            "auth/apikey/me: present the API key itself to revoke it (development mode has "
            "no keys; a token is revoked with its key)"
        )
    row = await asyncio.to_thread(tenants.revoke_key, state.store, key)
    return {"key_id": row.key_id, "revoked": True}


@router.post("/auth/token")
def auth_token(request: Request, state: StateDep, tenant: TenantDep) -> dict[str, str]:
    """The presented key (or a token of it) → a token standing for the key until it
    expires (jwt_ttl_s); sent as X-API-Key, it is checked as the key is."""
    issuer: TokenIssuer | None = state.keyring.tokens
    assert issuer is not None  # the app sets it
    key = request_key(request.scope["headers"]) or ""
    key_hash = state.keyring.key_hash(key) if key else hash_key("")
    return {"jwt": issuer.issue(key_hash, key_id(key) if key else "", tenant.tenant_id)}


def _utc(when: dt.datetime, field: str) -> dt.datetime:
    if when.tzinfo is None:
        raise InvalidRequestError(f"{field}: give a time zone (UTC), got {when.isoformat()}")
    return when.astimezone(dt.UTC)
