"""Shared route dependencies: the ServerState built by the app's lifespan, the tenant a
request acts for (authenticated by treadle.server.api.middleware.TenantMiddleware), and the
tenant's encryption key when the request carries one."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from treadle.artifacts import encryption
from treadle.server.core.state import ServerState
from treadle.server.tenancy.auth import Tenant, current_tenant


# async: FastAPI runs a plain-def dependency on a worker thread, a hop per request
async def get_state(request: Request) -> ServerState:
    return request.app.state.server


async def get_tenant(request: Request) -> Tenant:
    return getattr(request.state, "tenant", None) or current_tenant()


async def get_encryption_key(request: Request) -> bytes | None:
    """The tenant's key for encrypted model package versions (never stored)."""
    return encryption.parse_key(request.headers.get(encryption.HEADER))


StateDep = Annotated[ServerState, Depends(get_state)]
TenantDep = Annotated[Tenant, Depends(get_tenant)]
KeyDep = Annotated[bytes | None, Depends(get_encryption_key)]
