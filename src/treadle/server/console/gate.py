"""The console's door: a login page that keeps the API key in a cookie for the browser, and
the static files (the vendored htmx and uPlot, the console's own CSS and JS).

Pure ASGI, outside the TenantMiddleware, so the API's authentication stays the only one:
- /console/login (GET: the form; POST, from the same origin only: checks the key like any
  request, then sets it as an HttpOnly, SameSite=Strict cookie), /console/logout and
  /console/static/... are served here and hold no tenant data;
- a GET of a console page or of its JSON endpoints that carries no key header gets the
  cookie's key as X-API-Key, and is then authenticated and scoped as any API call (only GETs:
  a cookie never authorises a request that changes anything);
- the playground's chat (POST /v1/chat/completions) gets the cookie's key too, but only
  from a page of this origin: with the X-Treadle-Console header (a page of another site
  cannot send it without a CORS preflight, which this server never grants) and an Origin
  header naming this host;
- a console page answered 401 (no key, a revoked key) becomes a redirect to the login page.
In development mode (no tenants) every page opens without a key.
"""

from __future__ import annotations

import http.cookies
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Mount, Route, Router
from starlette.staticfiles import StaticFiles

from treadle.errors import AuthError
from treadle.server.tenancy.auth import request_key

COOKIE = "treadle_console_key"
PAGES = "/console"
DATA = "/api/v1/treadle/console/"
CHAT = "/v1/chat/completions"  # the playground's one call that changes something (metered)
CONSOLE_HEADER = b"x-treadle-console"
STATIC_DIR = Path(__file__).parent / "static"
COOKIE_MAX_AGE_S = 7 * 86400


class ConsoleGate:
    def __init__(self, app: Any):
        self.app = app
        self.public = Router(
            routes=[
                Route("/console/login", login, methods=["GET", "POST"]),
                Route("/console/logout", logout, methods=["GET", "POST"]),
                Mount("/console/static", StaticFiles(directory=STATIC_DIR), name="static"),
            ]
        )

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if path in ("/console/login", "/console/logout") or path.startswith("/console/static/"):
            await self.public(scope, receive, send)
            return
        page = path == PAGES or path.startswith(PAGES + "/")
        if path == CHAT and scope["method"] == "POST":
            await self.app(_playground_scope(scope), receive, send)
            return
        if not page and not path.startswith(DATA):
            await self.app(scope, receive, send)
            return
        headers = scope["headers"]
        if scope["method"] in ("GET", "HEAD") and request_key(headers) is None:
            key = _cookie(headers)
            if key:
                scope = {**scope, "headers": [*headers, (b"x-api-key", key.encode("latin-1"))]}
        if page:
            send = _login_on_401(send, path)
        await self.app(scope, receive, send)


def _playground_scope(scope: dict) -> dict:
    """A chat call of the playground page carries the cookie's key; any other is untouched."""
    headers = scope["headers"]
    names = {name for name, _ in headers}
    if CONSOLE_HEADER not in names or request_key(headers) is not None:
        return scope
    found = dict(headers)
    origin = found.get(b"origin", b"").decode("latin-1")
    if not origin or origin.split("://", 1)[-1] != found.get(b"host", b"").decode("latin-1"):
        return scope  # not from a page of this server
    key = _cookie(headers)
    if not key:
        return scope
    return {**scope, "headers": [*headers, (b"x-api-key", key.encode("latin-1"))]}


def _cookie(headers: list[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name == b"cookie":
            jar = http.cookies.SimpleCookie()
            try:
                jar.load(value.decode("latin-1"))
            except http.cookies.CookieError:
                continue
            if COOKIE in jar and jar[COOKIE].value:
                return jar[COOKIE].value
    return None


def _login_on_401(send: Any, path: str) -> Any:
    redirected = False

    async def wrapped(message: dict) -> None:
        nonlocal redirected
        if message["type"] == "http.response.start" and message["status"] == 401:
            redirected = True
            location = f"/console/login?next={quote(path)}".encode()
            headers = [(b"location", location), (b"content-length", b"0")]
            await send({"type": "http.response.start", "status": 303, "headers": headers})
            await send({"type": "http.response.body", "body": b""})
            return
        if not redirected:
            await send(message)

    return wrapped


def _next(value: str | None) -> str:
    # only a console page: never an open redirect
    if value and value.startswith(PAGES) and not value.startswith("//"):
        return value
    return PAGES


async def login(request: Request) -> Response:
    templates = request.app.state.console_templates
    keyring = request.app.state.keyring
    nxt = _next(request.query_params.get("next"))
    if request.method == "GET":
        context = {"next": nxt, "message": None, "dev_mode": keyring.dev_mode}
        return templates.TemplateResponse(request, "login.html", context)
    if not _same_origin(request):  # another site's form must not log this browser in
        return Response("cross-site login refused", status_code=403)
    form = parse_qs((await request.body()).decode("utf-8", "replace"))
    key = (form.get("key") or [""])[0].strip()
    nxt = _next((form.get("next") or [nxt])[0])
    try:
        await keyring.authenticate(key)
    except AuthError as e:
        context = {"next": nxt, "message": str(e), "dev_mode": keyring.dev_mode}
        return templates.TemplateResponse(request, "login.html", context, status_code=401)
    response = RedirectResponse(nxt, status_code=303)
    response.set_cookie(
        COOKIE,
        key,
        max_age=COOKIE_MAX_AGE_S,
        path="/",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )
    return response


def _same_origin(request: Request) -> bool:
    """Browsers send Origin with every form POST: one from another site is refused (it would
    log this browser in with a key of that site's choosing). No Origin: not a browser form."""
    origin = request.headers.get("origin")
    return origin is None or origin.split("://", 1)[-1] == request.headers.get("host", "")


async def logout(request: Request) -> Response:
    response = RedirectResponse("/console/login", status_code=303)
    response.delete_cookie(COOKIE, path="/")
    return response
