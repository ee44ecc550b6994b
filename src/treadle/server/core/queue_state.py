"""What a try_again reply says of a pending future's queue (`queue_state`, which the tinker
SDK's queue-state logger shows): paused_rate_limit while the tenant is at its
requests_per_minute quota (its next requests are refused until the minute slides),
paused_capacity while the engine cannot take the op on (a sample op while every replica's
decode batch is full, any op while no replica serves: a worker restarting), else active.
"""

from __future__ import annotations

from treadle.protocol.ops import OpKind
from treadle.server.core.state import ServerState
from treadle.server.tenancy.auth import current_tenant

ACTIVE = "active"
PAUSED_RATE_LIMIT = "paused_rate_limit"
PAUSED_CAPACITY = "paused_capacity"


def queue_state(state: ServerState, request_id: str) -> tuple[str, str | None]:
    """→ (queue_state, its reason) of a pending future of this process."""
    filed = state.futures.board.get(request_id)
    if filed is None:
        return ACTIVE, None
    tenant = current_tenant()
    per_minute = state.admission.quotas_of(tenant).requests_per_minute
    if state.admission.rate.full(tenant.tenant_id, per_minute):
        return PAUSED_RATE_LIMIT, (
            f"tenant {tenant.name!r} is at its requests_per_minute quota ({per_minute})"
        )
    engine = state.engines.get(filed.engine) if filed.engine else None
    if engine is None:
        return ACTIVE, None
    replicas = engine.status()
    serving = [r for r in replicas if r.status == "serving"]
    if not serving:
        why = ", ".join(sorted({r.status for r in replicas})) or "down"
        return PAUSED_CAPACITY, f"the engine of {engine.name!r} is {why}"
    full = state.config.max_sample_batch
    if filed.kind == OpKind.SAMPLE and all(r.decode_batch >= full for r in serving):
        return PAUSED_CAPACITY, (
            f"the decode batch of {engine.name!r} is full ({full} sample requests generating)"
        )
    return ACTIVE, None
