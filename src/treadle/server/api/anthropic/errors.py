"""Anthropic's error shape for /v1/messages: {"type": "error", "error": {"type", "message"}},
which the `anthropic` client raises as its usual exceptions (BadRequestError, ...)."""

from __future__ import annotations

from fastapi.responses import JSONResponse

PATH = "/v1/messages"

TYPE_OF_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    410: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def is_anthropic_path(path: str) -> bool:
    return path == PATH or path.startswith(PATH + "/")


def error_body(message: str, status: int) -> dict:
    kind = TYPE_OF_STATUS.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(message: str, status: int) -> JSONResponse:
    return JSONResponse(error_body(message, status), status_code=status)
