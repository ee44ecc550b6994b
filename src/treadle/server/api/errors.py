"""The one place errors become HTTP: every error class carries its own status and category
(treadle.errors), and every response is a JSON body naming the problem, in our shape, or
in OpenAI's on its /v1 paths and Anthropic's on /v1/messages, so that their clients parse
it."""

from __future__ import annotations

import logging

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from treadle.errors import TreadleError
from treadle.server.api.anthropic import errors as anthropic_errors
from treadle.server.api.openai import errors as openai_errors

log = logging.getLogger("treadle.server")


async def handle_error(request: Request, exc: Exception) -> JSONResponse:
    """An error raised by a route. A body always (the tinker SDK takes a 400 with an empty
    body for a proxy reset and retries it)."""
    if isinstance(exc, TreadleError):
        if exc.status >= 500:
            log.error("%s on %s: %s", type(exc).__name__, request.url.path, exc)
        response = error_response(request, str(exc), exc.category, exc.status)
        response.headers.update(exc.http_headers)  # a quota's Retry-After
        return response
    log.error("unhandled error on %s", request.url.path, exc_info=exc)
    message = f"internal server error: {type(exc).__name__}: {exc}"
    return error_response(request, message, "server", 500)


def error_response(request: Request, message: str, category: str, status: int) -> JSONResponse:
    if anthropic_errors.is_anthropic_path(request.url.path):
        return anthropic_errors.error_response(message, status)
    if openai_errors.is_openai_path(request.url.path):
        return openai_errors.error_response(message, status)
    return JSONResponse({"error": message, "category": category}, status_code=status)


async def handle_http_error(request: Request, exc: StarletteHTTPException) -> Response:
    """Routing's own errors (unknown route, wrong method) in our shapes, not FastAPI's."""
    if exc.status_code in (204, 304):
        return Response(status_code=exc.status_code, headers=exc.headers)
    message = f"{request.method} {request.url.path}: {exc.detail}"
    response = error_response(request, message, "user", exc.status_code)
    response.headers.update(exc.headers or {})
    return response


async def handle_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    problems = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        problems.append(f"{loc or 'body'}: {err.get('msg')}")
    if anthropic_errors.is_anthropic_path(request.url.path):
        return anthropic_errors.error_response("invalid request: " + "; ".join(problems), 400)
    if openai_errors.is_openai_path(request.url.path):
        return openai_errors.validation_error_response(exc.errors(), problems)
    return JSONResponse(
        {"error": "invalid request: " + "; ".join(problems), "category": "user"}, status_code=400
    )
