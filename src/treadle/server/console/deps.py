"""Who is looking at the console: the request's tenant, and whether it may see every tenant
(an admin key, or development mode)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from treadle.server.api.deps import StateDep, TenantDep
from treadle.server.console.views import ConsoleViews
from treadle.server.tenancy.auth import Tenant, request_key
from treadle.server.tenancy.tenants import is_admin_key


@dataclass(frozen=True)
class Viewer:
    tenant: Tenant
    admin: bool
    dev_mode: bool

    def scope(self, views: ConsoleViews, tenant: str | None = None) -> str | None:
        """The tenant whose data is shown: the viewer's own, or for an admin every tenant
        (None) or the one asked for with ?tenant= (a name or an id)."""
        if not self.admin:
            return self.tenant.tenant_id
        return views.tenant_id_of(tenant)


async def get_views(request: Request) -> ConsoleViews:
    return request.app.state.console


def get_viewer(request: Request, state: StateDep, tenant: TenantDep) -> Viewer:
    # plain def: the admin lookup reads the database, off the event loop
    dev = state.keyring.dev_mode
    admin = dev or is_admin_key(state.store, request_key(request.scope["headers"]))
    return Viewer(tenant=tenant, admin=admin, dev_mode=dev)


ViewsDep = Annotated[ConsoleViews, Depends(get_views)]
ViewerDep = Annotated[Viewer, Depends(get_viewer)]
