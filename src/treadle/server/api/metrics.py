"""GET /metrics: the API process's Prometheus metrics (treadle.server.observe.metrics), in
the text exposition format.

An operator's endpoint: it names served models, op kinds, routes and (a bounded set of)
tenant names. Who may read it:
- every caller in development mode (no tenants: no key is checked anywhere);
- a client whose address is in `metrics_networks` (ServerConfig: a Prometheus on the
  operator's own network), without a key;
- anyone else with an admin key (`treadle admin create-key --admin`), e.g. Prometheus's
  `authorization: {credentials: KEY}`: a tenant's key gets 403.
"""

from __future__ import annotations

import asyncio
import ipaddress
from functools import lru_cache

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from treadle.errors import AuthError, ForbiddenError
from treadle.server.api.deps import StateDep
from treadle.server.observe.metrics import LiveFigures, ModelLive
from treadle.server.tenancy.auth import request_key
from treadle.server.tenancy.tenants import is_admin_key

router = APIRouter()
PATH = "/metrics"


@router.get(PATH, include_in_schema=True)
async def metrics(request: Request, state: StateDep) -> Response:
    """Prometheus metrics of this API process and its workers (operators only)."""
    await _check_access(request, state)
    body = await asyncio.to_thread(generate_latest, REGISTRY)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


async def _check_access(request: Request, state: StateDep) -> None:
    if state.keyring.dev_mode:
        return
    client = request.scope.get("client")
    if client and _in_networks(client[0], state.config.metrics_networks):
        return
    key = request_key(request.scope["headers"])
    if key is None:
        raise AuthError("GET /metrics: an admin key is required from this address")
    await state.keyring.authenticate(key)  # a revoked or unknown key: 401
    if not await asyncio.to_thread(is_admin_key, state.store, key):
        raise ForbiddenError("GET /metrics: an operator's endpoint; it takes an admin key")


def _in_networks(host: str, networks: str) -> bool:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return any(address in net for net in _parse(networks))


@lru_cache(maxsize=8)
def _parse(networks: str) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    return tuple(
        ipaddress.ip_network(n.strip(), strict=False) for n in networks.split(",") if n.strip()
    )


def live_figures(state) -> LiveFigures:
    """What the server's workers, sessions and samplers are doing now (read at each scrape)."""
    models = []
    for engine in state.engines.all():
        replicas = engine.status()
        models.append(
            ModelLive(
                engine.name,
                sum(r.queue_depth for r in replicas),
                sum(r.running for r in replicas),
                sum(r.decode_batch for r in replicas),
            )
        )
    sessions = state.sessions
    return LiveFigures(
        models=models,
        sessions=len(sessions.cached()),
        samplers=state.samplers.live_count(),
    )
