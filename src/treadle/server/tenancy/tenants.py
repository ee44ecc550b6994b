"""The tenant and key store behind `treadle admin`: plain functions of a Store.

They write the server's database directly, so they work with the server up or down; a
running server sees a key's change (a revocation) within its auth_cache_ttl_s
(treadle.server.tenancy.auth) and a new key at once.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import or_, select, update

from treadle.errors import ConflictError, InvalidRequestError, NotFoundError
from treadle.server.storage.database import Store
from treadle.server.storage.rows import AdminKeyRow, ApiKeyRow, TenantRow, new_id, utcnow
from treadle.server.tenancy.auth import hash_key, key_id, new_key
from treadle.server.tenancy.quotas import QUOTA_FIELDS, Quotas


def _check_name(name: str) -> str:
    if not name or len(name) > 128 or any(c.isspace() for c in name):
        raise InvalidRequestError(
            f"tenant name: expected 1-128 characters without spaces, got {name!r}"
        )
    return name


def find_tenant(store: Store, name_or_id: str) -> TenantRow:
    rows = store.query(
        select(TenantRow).where(
            or_(TenantRow.name == name_or_id, TenantRow.tenant_id == name_or_id)
        )
    )
    if not rows:
        raise NotFoundError(f"tenant {name_or_id!r} not found")
    return rows[0]


def create_tenant(store: Store, name: str, quotas: dict[str, Any] | None = None) -> TenantRow:
    """A new tenant (its first one ends the server's development mode)."""
    _check_name(name)
    if store.query(select(TenantRow).where(TenantRow.name == name)):
        raise ConflictError(f"tenant {name!r} already exists")
    row = TenantRow(tenant_id=new_id(), name=name, quotas=_clean(quotas), created_at=utcnow())
    store.add(row)
    return row


def create_key(store: Store, tenant: str, admin: bool = False) -> tuple[str, ApiKeyRow]:
    """→ (the key, its row). The key is returned once: only its sha256 is stored.

    An admin key acts for its tenant everywhere, and sees every tenant in the console."""
    owner = find_tenant(store, tenant)
    key = new_key()
    row = ApiKeyRow(
        key_hash=hash_key(key), key_id=key_id(key), tenant_id=owner.tenant_id, created_at=utcnow()
    )
    store.add(row)
    if admin:
        store.add(AdminKeyRow(key_hash=row.key_hash, created_at=utcnow()))
    return key, row


def is_admin_key(store: Store, key: str | None) -> bool:
    """Whether a (valid) key was made with `create-key --admin`."""
    if not key:
        return False
    with store.engine.connect() as conn:
        stmt = select(AdminKeyRow.key_hash).where(AdminKeyRow.key_hash == hash_key(key))
        return conn.execute(stmt).first() is not None


def revoke_key(store: Store, key_or_id: str) -> ApiKeyRow:
    """Revoke a key, given whole or by its id (its first characters, from list-keys)."""
    rows = store.query(
        select(ApiKeyRow).where(
            or_(ApiKeyRow.key_hash == hash_key(key_or_id), ApiKeyRow.key_id == key_or_id)
        )
    )
    if not rows:
        raise NotFoundError(f"API key {key_id(key_or_id)!r} not found")
    row = rows[0]
    if row.revoked_at is None:
        row.revoked_at = utcnow()
        store.set(ApiKeyRow, row.key_hash, revoked_at=row.revoked_at)
    return row


def set_quotas(store: Store, tenant: str, values: dict[str, int | None]) -> TenantRow:
    """Set the given quotas of a tenant (0 clears one: the config file's applies again)."""
    row = find_tenant(store, tenant)
    quotas = dict(row.quotas or {})
    for name, value in values.items():
        if name not in QUOTA_FIELDS:
            raise InvalidRequestError(f"quota: unknown {name!r}; known: {list(QUOTA_FIELDS)}")
        if value is None:
            continue
        if value == 0:
            quotas.pop(name, None)
        else:
            quotas[name] = value
    quotas = _clean(quotas)
    with store.session.begin() as s:
        s.execute(
            update(TenantRow).where(TenantRow.tenant_id == row.tenant_id).values(quotas=quotas)
        )
    row.quotas = quotas
    return row


def list_tenants(store: Store) -> list[dict[str, Any]]:
    """Every tenant with its quotas and its keys (ids only)."""
    keys = store.query(select(ApiKeyRow).order_by(ApiKeyRow.created_at))
    admins = set(store.query(select(AdminKeyRow.key_hash)))
    out = []
    for t in store.query(select(TenantRow).order_by(TenantRow.created_at)):
        out.append(
            {
                "tenant_id": t.tenant_id,
                "name": t.name,
                "quotas": t.quotas or {},
                "keys": [
                    {
                        "key_id": k.key_id,
                        "created_at": k.created_at.isoformat(timespec="seconds"),
                        "revoked": k.revoked_at is not None,
                        **({"admin": True} if k.key_hash in admins else {}),
                    }
                    for k in keys
                    if k.tenant_id == t.tenant_id
                ],
            }
        )
    return out


def _clean(quotas: dict[str, Any] | None) -> dict[str, int] | None:
    if not quotas:
        return None
    checked = Quotas(**quotas).model_dump(exclude_none=True)
    return checked or None
