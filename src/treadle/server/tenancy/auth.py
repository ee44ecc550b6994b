"""Who a request acts for: API keys → tenants, and the tenant of the request being served.

A server whose database holds no tenant runs in single-user development mode: every request
acts for DEV_TENANT and keys are not checked. Once a tenant exists (`treadle admin
create-tenant`), every request but the health check needs a key, in `X-API-Key` (what the
tinker SDK sends) or `Authorization: Bearer`; an unknown or revoked key gets a 401.

Keys are looked up in the database on every request, never cached: `treadle admin
revoke-key` (another process) stops a key at its very next request. The lookup is one
primary-key read (the sha256 of the key).

The tenant is held in a context variable for the whole request (`current_tenant()`), so
that every layer sees it without passing it down: the core components check ownership
against it (`owns`), and every ORM read made while serving a request is filtered to the
tenant's rows (`install_tenant_filter`), whatever route issued it.
"""

from __future__ import annotations

import contextvars
import datetime as dt
import hashlib
import json
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, bindparam, event, select
from sqlalchemy.orm import sessionmaker, with_loader_criteria

from treadle.errors import AuthError
from treadle.server.storage.rows import DEFAULT_TENANT_ID, ApiKeyRow, Base, TenantRow

log = logging.getLogger("treadle.auth")

KEY_PREFIX = "tml-"  # the tinker SDK refuses keys without it
KEY_ID_CHARS = 12  # the key's public part: "tml-" + 8 characters, shown by list-keys
# Paths served without a key: the health check (launchers poll it before they hold a key)
# and the API's own description.
PUBLIC_PATHS = frozenset({"/api/v1/healthz", "/openapi.json", "/docs", "/docs/oauth2-redirect"})
# Signed download links of checkpoint files: the signature is the grant, not a key.
PUBLIC_PREFIXES = ("/api/v1/treadle/files/",)
# While in development mode, how often to look whether a tenant has been created since.
TENANT_RECHECK_S = 1.0


@dataclass(frozen=True)
class Tenant:
    """Who a request acts for. Every stored resource carries a tenant_id."""

    tenant_id: str
    name: str


DEV_TENANT = Tenant(tenant_id=DEFAULT_TENANT_ID, name="default")
"""The only tenant of a server with no tenants configured (single-user development mode)."""

_CURRENT: contextvars.ContextVar[Tenant | None] = contextvars.ContextVar(
    "treadle_tenant", default=None
)


def current_tenant() -> Tenant:
    """The tenant of the request being served (DEV_TENANT outside a request)."""
    return _CURRENT.get() or DEV_TENANT


def in_request() -> bool:
    return _CURRENT.get() is not None


def set_current_tenant(tenant: Tenant | None) -> contextvars.Token:
    return _CURRENT.set(tenant)


def reset_current_tenant(token: contextvars.Token) -> None:
    _CURRENT.reset(token)


# ---- keys ----
def new_key() -> str:
    """A fresh API key: 'tml-' and 43 url-safe characters (256 random bits)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    # A fast hash is enough: the key is random with 256 bits, not a password to brute-force.
    return hashlib.sha256(key.encode()).hexdigest()


def key_id(key: str) -> str:
    return key[:KEY_ID_CHARS]


_KEYS, _TENANTS = ApiKeyRow.__table__, TenantRow.__table__
# Built once: building a select costs more than running it (about 80 µs a request in all).
_KEY_LOOKUP = (
    select(_KEYS.c.revoked_at, _TENANTS.c.tenant_id, _TENANTS.c.name, _TENANTS.c.quotas)
    .join(_TENANTS, _TENANTS.c.tenant_id == _KEYS.c.tenant_id)
    .where(_KEYS.c.key_hash == bindparam("key_hash"))
)


class KeyRing:
    """Resolves a request's key to its tenant, reading the database every time."""

    def __init__(self, engine: Engine, on_quotas: Callable[[str, dict[str, Any]], None]):
        self.engine = engine
        self._on_quotas = on_quotas  # hands each tenant's stored quotas on as they are read
        self.dev_mode = not self._any_tenant()
        self._checked_at = time.monotonic()

    def _any_tenant(self) -> bool:
        with self.engine.connect() as conn:
            return conn.execute(select(TenantRow.tenant_id).limit(1)).first() is not None

    def _still_dev_mode(self) -> bool:
        # A tenant created while the server runs ends development mode within a second.
        if self.dev_mode and time.monotonic() - self._checked_at > TENANT_RECHECK_S:
            self._checked_at = time.monotonic()
            if self._any_tenant():
                log.warning("a tenant was created: API keys are required from now on")
                self.dev_mode = False
        return self.dev_mode

    def authenticate(self, key: str | None) -> Tenant:
        """→ the key's tenant; AuthError when it is missing, unknown or revoked."""
        if self._still_dev_mode():
            return DEV_TENANT
        if not key:
            raise AuthError(
                "missing API key: send it in the X-API-Key header or as Authorization: Bearer"
            )
        with self.engine.connect() as conn:
            row = conn.execute(_KEY_LOOKUP, {"key_hash": hash_key(key)}).first()
        if row is None:
            raise AuthError(f"API key {key_id(key)}... is not recognised by this server")
        if row.revoked_at is not None:
            raise AuthError(f"API key {key_id(key)}... was revoked on {_day(row.revoked_at)}")
        quotas = row.quotas if not isinstance(row.quotas, str) else json.loads(row.quotas)
        self._on_quotas(row.tenant_id, quotas or {})
        return Tenant(tenant_id=row.tenant_id, name=row.name)


def _day(when: dt.datetime | str) -> str:
    return when.isoformat(timespec="seconds") if isinstance(when, dt.datetime) else str(when)


def request_key(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The API key of raw ASGI headers: X-API-Key first, else Authorization: Bearer."""
    bearer = None
    for name, value in headers:
        if name == b"x-api-key":
            return value.decode("latin-1").strip()
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                bearer = token.strip()
    return bearer


# ---- every ORM read of a request sees its tenant's rows only ----
def install_tenant_filter(sessions: sessionmaker) -> Callable[[], None]:
    """Add `tenant_id == current tenant` to every ORM SELECT made while serving a request
    through `sessions` (the app's Store), for every mapped class with a tenant_id column;
    → a function that removes the filter again (at shutdown).

    Ownership is also checked explicitly where resources are used (treadle.server.core);
    this makes a listing or lookup that forgets to filter return nothing rather than
    another tenant's rows.
    """
    event.listen(sessions, "do_orm_execute", _filter_by_tenant)
    return lambda: event.remove(sessions, "do_orm_execute", _filter_by_tenant)


def _filter_by_tenant(state: Any) -> None:
    tenant = _CURRENT.get()
    if tenant is None or not state.is_select or state.is_column_load or state.is_relationship_load:
        return
    options = [
        with_loader_criteria(mapper.class_, _owned_by(tenant.tenant_id), include_aliases=True)
        for mapper in Base.registry.mappers
        if "tenant_id" in mapper.columns and mapper.class_ not in (ApiKeyRow, TenantRow)
    ]
    if options:
        state.statement = state.statement.options(*options)


def _owned_by(tenant_id: str) -> Any:
    return lambda cls: cls.tenant_id == tenant_id


def owns(tenant_id: str | None) -> bool:
    """Whether the request being served may see a resource of `tenant_id` (work done
    outside a request, on the engine and journal threads, sees everything)."""
    return not in_request() or (tenant_id or DEFAULT_TENANT_ID) == current_tenant().tenant_id
