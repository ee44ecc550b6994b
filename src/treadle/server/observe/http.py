"""The ASGI middleware that counts every HTTP request (by its route's path template, method
and status) and, when tracing is on, makes it the server span its trace starts from.

Pure ASGI, outermost, so that it sees the answers of the other middleware too (401, 413).
The route label is the template the router matched (`/api/v1/treadle/console/sessions/
{session_id}`), never the raw path: a label per id would grow without bound. A request no
route of the app matched (a 404, a console login or static file) is labelled "unmatched".
"""

from __future__ import annotations

import time
from typing import Any

from treadle.protocol import tracing
from treadle.server.observe import metrics

UNMATCHED = "unmatched"


class ObserveRequests:
    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        answer = [500]  # an exception before the answer started: the server error it becomes

        async def noted(message: dict) -> None:
            if message["type"] == "http.response.start":
                answer[0] = message["status"]
            await send(message)

        tracer = tracing.tracer()
        if tracer is None:
            try:
                await self.app(scope, receive, noted)
            finally:
                self._count(scope, answer[0], time.perf_counter() - t0)
            return
        await self._traced(tracer, scope, receive, noted, answer, t0)

    def _count(self, scope: dict, status: int, seconds: float) -> None:
        route = _route_of(scope, status)
        method = scope["method"]
        metrics.child(metrics.HTTP_REQUESTS, route, method, str(status)).inc()
        metrics.child(metrics.HTTP_SECONDS, route, method).observe(seconds)

    async def _traced(
        self, tracer: Any, scope: dict, receive: Any, send: Any, answer: list[int], t0: float
    ) -> None:
        from opentelemetry import propagate
        from opentelemetry.trace import SpanKind, Status, StatusCode

        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        method = scope["method"]
        with tracer.start_as_current_span(
            method,
            context=propagate.extract(headers),
            kind=SpanKind.SERVER,
            attributes={"http.request.method": method, "url.path": scope.get("path", "")},
        ) as span:
            try:
                await self.app(scope, receive, send)
            finally:
                status = answer[0]
                route = _route_of(scope, status)
                span.update_name(f"{method} {route}")
                span.set_attribute("http.route", route)
                span.set_attribute("http.response.status_code", status)
                if status >= 500:
                    span.set_status(Status(StatusCode.ERROR))
                self._count(scope, status, time.perf_counter() - t0)


def _route_of(scope: dict, status: int) -> str:
    route = scope.get("route")
    if route is not None:
        return getattr(route, "path", UNMATCHED)
    if status == 404:
        return UNMATCHED
    # a middleware answered (401, 413) or handed the router a copy of the scope (the
    # console's gate): find the template the router would have matched
    app = scope.get("app")
    for candidate in getattr(getattr(app, "router", None), "routes", ()):
        match, _ = candidate.matches(scope)
        if match.name == "FULL":
            return getattr(candidate, "path", UNMATCHED)
    return UNMATCHED
