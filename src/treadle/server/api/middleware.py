"""The ASGI middleware every request passes before its route: who it acts for (its tenant,
and the public id of its key), and errors written before any route runs (401, 413) in the
one JSON shape of each API.

Pure ASGI (no BaseHTTPMiddleware): nothing is buffered, and the tenant is set in the context
the route runs in.
"""

from __future__ import annotations

import json
from typing import Any

from treadle.errors import AuthError
from treadle.server.api.openai.errors import error_body, is_openai_path
from treadle.server.tenancy.auth import (
    DEV_TENANT,
    PUBLIC_PATHS,
    PUBLIC_PREFIXES,
    KeyRing,
    key_id,
    request_key,
    reset_current_key_id,
    reset_current_tenant,
    set_current_key_id,
    set_current_tenant,
)
from treadle.server.tenancy.tokens import is_token


async def send_error(
    send: Any, status: int, message: str, path: str, category: str = "user", headers=()
) -> None:
    """An error answered by a middleware: OpenAI's shape on /v1 (its clients raise their
    usual exceptions), the Tinker API's elsewhere."""
    payload = (
        error_body(message, status)
        if is_openai_path(path)
        else {"error": message, "category": category}
    )
    body = json.dumps(payload).encode()
    head = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *headers,
    ]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})


class TenantMiddleware:
    """Pure ASGI: authenticates each HTTP request and sets its tenant for the handlers
    (the context variable, and request.state.tenant for TenantDep)."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or _is_public(scope["path"]):
            await self.app(scope, receive, send)
            return
        keyring: KeyRing | None = getattr(scope["app"].state, "keyring", None)
        if keyring is None:  # still starting up
            tenant = DEV_TENANT
        else:
            try:
                # no database read on the event loop (treadle.server.tenancy.auth)
                tenant = await keyring.authenticate(request_key(scope["headers"]))
            except AuthError as e:
                path = scope.get("path", "")
                # a token refused: the tinker SDK exchanges its key again and retries once
                token = is_token(request_key(scope["headers"]))
                challenge = b'Bearer error="invalid_token"' if token else b"Bearer"
                await send_error(
                    send, 401, str(e), path, headers=[(b"www-authenticate", challenge)]
                )
                return
        scope.setdefault("state", {})["tenant"] = tenant
        token = set_current_tenant(tenant)
        try:
            await self.app(scope, receive, send)
        finally:
            reset_current_tenant(token)


class KeyIdMiddleware:
    """Pure ASGI: notes the public id of the request's key for the handlers, never the key
    (per-key spend caps: treadle.server.tenancy.spend; the console's key column)."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        key = request_key(scope["headers"])
        token = set_current_key_id(key_id(key) if key else None)
        try:
            await self.app(scope, receive, send)
        finally:
            reset_current_key_id(token)


def _is_public(path: str) -> bool:
    return path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES)
