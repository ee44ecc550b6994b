"""Shared route dependencies: the Service built by the app's lifespan, and the tenant a
request acts for (authenticated by treadle.server.auth.TenantMiddleware)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from treadle.server.auth import DEV_TENANT, Tenant, current_tenant
from treadle.server.service import Service

__all__ = ["DEV_TENANT", "ServiceDep", "Tenant", "TenantDep", "get_service", "get_tenant"]


async def get_service(request: Request) -> Service:
    # async: FastAPI runs a plain-def dependency on a worker thread, a hop per request
    return request.app.state.service


async def get_tenant(request: Request) -> Tenant:
    return getattr(request.state, "tenant", None) or current_tenant()


ServiceDep = Annotated[Service, Depends(get_service)]
TenantDep = Annotated[Tenant, Depends(get_tenant)]
