"""Per-tenant quotas: what one tenant may hold or ask at once, so none starves the others.

A quota left unset (None) is unlimited. The values of a tenant come from, field by field,
the tenant's row in the database (`treadle admin set-quotas`; read with the tenant's key,
so a change applies within the server's auth_cache_ttl_s), else the config file's
`tenant_quotas[<tenant name>]`, else the config file's `quotas` (every tenant's default).

Over a quota the request gets a 429 whose message names the quota, its value and what was
asked. The requests-per-minute quota is the only one that clears with time: its 429 carries
Retry-After and the SDKs retry it, so a loop's futures are delayed, never lost. A session
or adapter quota clears when the tenant ends a session or unloads a model; those carry
Retry-After too (the SDKs keep trying while another session of the tenant winds down).
A request over the rank or token quota can never pass: it says `x-should-retry: false`.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from pydantic import BaseModel, field_validator

from treadle.errors import QuotaExceededError

# How long a client should wait before asking again for a session or adapter slot.
SLOT_RETRY_AFTER_S = 5.0
QUOTA_FIELDS = (
    "max_concurrent_sessions",
    "max_adapters_in_memory",
    "max_lora_rank",
    "max_tokens_per_request",
    "requests_per_minute",
    "max_storage_bytes",
)


class Quotas(BaseModel):
    max_concurrent_sessions: int | None = None
    """Sessions of the tenant active at once (a session ends on close or heartbeat timeout)."""
    max_adapters_in_memory: int | None = None
    """LoRA adapters the tenant holds in accelerator memory: training models plus samplers
    loaded from saved checkpoints (in-memory sampler snapshots of a model are not counted)."""
    max_lora_rank: int | None = None
    """The largest LoRA rank of a training model."""
    max_tokens_per_request: int | None = None
    """Tokens of one request: a forward/forward_backward's model inputs summed; a sample's
    prompt plus num_samples × max_tokens."""
    requests_per_minute: int | None = None
    """Operations (calls that return a future) per sliding minute; polls, heartbeats and
    session bookkeeping are free."""
    max_storage_bytes: int | None = None
    """Bytes of checkpoints and model package versions the tenant keeps: a save (or an
    upload, or a copy) while the tenant holds this much is refused with a 403 naming it."""

    @field_validator(*QUOTA_FIELDS)
    @classmethod
    def _positive(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError(f"a quota must be >= 1 or unset (unlimited), got {v}")
        return v

    def overlay(self, values: dict[str, Any] | None) -> Quotas:
        """These quotas with the set fields of `values` on top."""
        given = {k: v for k, v in (values or {}).items() if k in QUOTA_FIELDS and v is not None}
        return self.model_copy(update=Quotas(**given).model_dump(exclude_unset=True))


def over(
    quota: str, limit: int, asked: str, hint: str, retry_after_s: float | None
) -> QuotaExceededError:
    return QuotaExceededError(f"quota {quota} ({limit}) exceeded: {asked}; {hint}", retry_after_s)


def check_slot(quota: str, limit: int, held: int, what: str) -> None:
    """A quota of things held at once (sessions, adapters): freed when one ends."""
    if held >= limit:
        hint = "end a session or unload a model first, or retry later"
        raise over(quota, limit, what, hint, SLOT_RETRY_AFTER_S)


def check_rank(quotas: Quotas, rank: int) -> None:
    if quotas.max_lora_rank is not None and rank > quotas.max_lora_rank:
        raise over(
            "max_lora_rank",
            quotas.max_lora_rank,
            f"asked for rank {rank}",
            "use a smaller rank",
            None,
        )


class RateLimiter:
    """Requests per sliding minute, per tenant (memory only: a restart forgets the window).

    `window_s` is 60 in service; tests shorten it to see the window slide."""

    def __init__(self, window_s: float = 60.0) -> None:
        self.window_s = window_s
        self._times: dict[str, deque[float]] = {}

    def take(self, tenant_id: str, per_minute: int | None) -> None:
        """Count one request of the tenant, or raise QuotaExceededError if its minute is full."""
        if per_minute is None:
            return
        now = time.monotonic()
        times = self._times.setdefault(tenant_id, deque())
        while times and times[0] <= now - self.window_s:
            times.popleft()
        if len(times) >= per_minute:
            wait = times[0] + self.window_s - now
            raise over(
                "requests_per_minute",
                per_minute,
                f"{len(times)} requests in the last {self.window_s:g} s",
                f"retry in {wait:.1f} s",
                wait,
            )
        times.append(now)

    def full(self, tenant_id: str, per_minute: int | None) -> bool:
        """Whether the tenant's minute is full now (its next request would be refused)."""
        if per_minute is None:
            return False
        cutoff = time.monotonic() - self.window_s
        return sum(1 for t in self._times.get(tenant_id, ()) if t > cutoff) >= per_minute


class QuotaBook:
    """The quotas in force for each tenant: the config file's defaults, its per-tenant
    overrides, and the tenant's own row (as last read by the key ring), field by field."""

    def __init__(self, defaults: Quotas, per_tenant: dict[str, Quotas]):
        self.defaults = defaults
        self.per_tenant = per_tenant
        self.from_db: dict[str, dict[str, Any]] = {}  # tenant_id → its row's quotas

    def of(self, tenant_id: str, tenant_name: str) -> Quotas:
        quotas = self.defaults
        if tenant_name in self.per_tenant:
            quotas = quotas.overlay(self.per_tenant[tenant_name].model_dump())
        return quotas.overlay(self.from_db.get(tenant_id))
