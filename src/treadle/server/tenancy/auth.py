"""Who a request acts for: API keys → tenants, and the tenant of the request being served.

A server whose database holds no tenant runs in single-user development mode: every request
acts for DEV_TENANT and keys are not checked. Once a tenant exists (`treadle admin
create-tenant`), every request but the health check needs a key, in `X-API-Key` (what the
tinker SDK sends) or `Authorization: Bearer`; an unknown or revoked key gets a 401.

No request reads the database on the event loop: what a key maps to (its tenant, or that it
was revoked) and whether any tenant exists are kept for `ttl_s` (ServerConfig
auth_cache_ttl_s, 5 s), and read again in a worker thread once older. A key seen for the
first time is read at once (off the loop), so a new key works at its first request;
`treadle admin revoke-key` (another process) stops a key within ttl_s; a tenant created
while the server runs in development mode ends that mode within ttl_s. The read is one
primary-key lookup (the sha256 of the key); concurrent requests with one key share it.

The tenant (and the public id of the request's key, `current_key_id()`: per-key spend caps)
is held in a context variable for the whole request (`current_tenant()`), so
that every layer sees it without passing it down: the core components check ownership
against it (`owns`), and every ORM read made while serving a request is filtered to the
tenant's rows (`install_tenant_filter`), whatever route issued it.
"""

from __future__ import annotations

import asyncio
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
from treadle.server.tenancy.tokens import TokenIssuer, is_token, unverified_key_id

log = logging.getLogger("treadle.auth")

KEY_PREFIX = "tml-"  # the tinker SDK refuses keys without it
KEY_ID_CHARS = 12  # the key's public part: "tml-" + 8 characters, shown by list-keys
# Paths served without a key: the health check (launchers poll it before they hold a key)
# and the API's own description.
# /metrics checks its own access (an operator's: treadle.server.api.metrics)
PUBLIC_PATHS = frozenset(
    {"/api/v1/healthz", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/metrics"}
)
# Signed links (checkpoint files to download, external-weights files to upload, a session's
# trace): the signature is the grant, not a key.
PUBLIC_PREFIXES = ("/api/v1/treadle/files/", "/api/v1/treadle/uploads/", "/api/v1/treadle/traces/")
# How long what a key maps to (and "no tenant exists") is trusted before it is read again.
AUTH_CACHE_TTL_S = 5.0


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


_KEY_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("treadle_key_id", default=None)


def current_key_id() -> str | None:
    """The public id (first KEY_ID_CHARS characters) of the request's API key, if it sent
    one (set by treadle.server.api.middleware.KeyIdMiddleware; never the key itself)."""
    return _KEY_ID.get()


def set_current_key_id(kid: str | None) -> contextvars.Token:
    return _KEY_ID.set(kid)


def reset_current_key_id(token: contextvars.Token) -> None:
    _KEY_ID.reset(token)


# ---- keys ----
def new_key() -> str:
    """A fresh API key: 'tml-' and 43 url-safe characters (256 random bits)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    # A fast hash is enough: the key is random with 256 bits, not a password to brute-force.
    return hashlib.sha256(key.encode()).hexdigest()


def key_id(key: str) -> str:
    """A key's public id; a token's names its key's (unverified: a forged token is refused
    by the key ring, this only labels)."""
    if is_token(key):
        return unverified_key_id(key) or key[:KEY_ID_CHARS]
    return key[:KEY_ID_CHARS]


_KEYS, _TENANTS = ApiKeyRow.__table__, TenantRow.__table__
# Built once: building a select costs more than running it (about 80 µs a request in all).
_KEY_LOOKUP = (
    select(_KEYS.c.revoked_at, _TENANTS.c.tenant_id, _TENANTS.c.name, _TENANTS.c.quotas)
    .join(_TENANTS, _TENANTS.c.tenant_id == _KEYS.c.tenant_id)
    .where(_KEYS.c.key_hash == bindparam("key_hash"))
)


@dataclass(frozen=True)
class _KeyRow:
    """What the database says of one key, and when its read began (the ring's clock)."""

    tenant: Tenant
    revoked_at: dt.datetime | str | None
    quotas: dict[str, Any]
    read_at: float


class KeyRing:
    """Resolves a request's key to its tenant from what was read at most `ttl_s` ago; reads
    the database in a worker thread, never on the event loop."""

    def __init__(
        self,
        engine: Engine,
        on_quotas: Callable[[str, dict[str, Any]], None],
        ttl_s: float = AUTH_CACHE_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.engine = engine
        self._on_quotas = on_quotas  # hands each tenant's stored quotas on as they are read
        self.ttl_s = ttl_s
        self._clock = clock
        # read at start-up, before any request is served
        self.dev_mode = not self._any_tenant()
        self._checked_at = clock()
        self._keys: dict[str, _KeyRow] = {}  # key hash → its row as last read
        self._reads: dict[str, asyncio.Future] = {}  # reads in flight, shared by requests
        # short-lived tokens for keys (POST /api/v1/auth/token), set by the app
        self.tokens: TokenIssuer | None = None

    def key_hash(self, key: str) -> str:
        """The hash of the key a request stands for: its own, or the key a token of this
        server was issued for (AuthError for a token it did not issue or that expired)."""
        if self.tokens is not None and is_token(key):
            return self.tokens.read(key).key_hash
        return hash_key(key)

    def _any_tenant(self) -> bool:
        with self.engine.connect() as conn:
            return conn.execute(select(TenantRow.tenant_id).limit(1)).first() is not None

    def _read_key(self, key_hash: str) -> _KeyRow | None:
        began = self._clock()  # what is read is trusted ttl_s from before the read
        with self.engine.connect() as conn:
            row = conn.execute(_KEY_LOOKUP, {"key_hash": key_hash}).first()
        if row is None:
            return None
        quotas = row.quotas if not isinstance(row.quotas, str) else json.loads(row.quotas)
        tenant = Tenant(tenant_id=row.tenant_id, name=row.name)
        return _KeyRow(tenant, row.revoked_at, quotas or {}, began)

    async def _shared(self, name: str, read: Callable[[], Any]) -> Any:
        """`read()` in a worker thread; requests asking for the same `name` meanwhile share
        its answer (a cancelled request never cancels it for the others)."""
        running = self._reads.get(name)
        if running is None:
            running = self._reads[name] = asyncio.ensure_future(asyncio.to_thread(read))
            running.add_done_callback(lambda _: self._reads.pop(name, None))
        return await asyncio.shield(running)

    async def _still_dev_mode(self) -> bool:
        # A tenant created while the server runs ends development mode within ttl_s.
        if self.dev_mode and (began := self._clock()) - self._checked_at >= self.ttl_s:
            any_tenant = await self._shared("", self._any_tenant)
            self._checked_at = max(self._checked_at, began)
            if any_tenant and self.dev_mode:
                log.warning("a tenant was created: API keys are required from now on")
                self.dev_mode = False
        return self.dev_mode

    async def authenticate(self, key: str | None) -> Tenant:
        """→ the key's tenant; AuthError when it is missing, unknown or revoked."""
        if await self._still_dev_mode():
            return DEV_TENANT
        if not key:
            raise AuthError(
                "missing API key: send it in the X-API-Key header or as Authorization: Bearer"
            )
        key_hash = self.key_hash(key)
        row = self._keys.get(key_hash)
        if row is None or self._clock() - row.read_at >= self.ttl_s:
            row = await self._shared(key_hash, lambda: self._read_key(key_hash))
            if row is None:  # unknown keys are not kept: a key made a moment later works
                self._keys.pop(key_hash, None)
                raise AuthError(f"API key {key_id(key)}... is not recognised by this server")
            self._keys[key_hash] = row
            self._on_quotas(row.tenant.tenant_id, row.quotas)
        if row.revoked_at is not None:
            raise AuthError(f"API key {key_id(key)}... was revoked on {_day(row.revoked_at)}")
        return row.tenant


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
