"""OpenAI's error shape for the /v1 routes: {"error": {"message", "type", "param", "code"}}.

The app's one error handler calls `error_response` for paths under /v1, so that OpenAI
clients raise their usual exceptions (BadRequestError, NotFoundError, ...) with our message.
"""

from __future__ import annotations

import re

from fastapi.responses import JSONResponse

PREFIX = "/v1"

TYPE_OF_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    409: "invalid_request_error",
    410: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}

# A message that opens with "field: ..." or "messages[2].content: ..." names its param.
_PARAM = re.compile(r"^([A-Za-z_][\w]*(?:\[\d+\]|\.[A-Za-z_]\w*)*):\s")


def is_openai_path(path: str) -> bool:
    return path == PREFIX or path.startswith(PREFIX + "/")


def param_of(message: str) -> str | None:
    m = _PARAM.match(message)
    return m.group(1) if m else None


def error_body(message: str, status: int, param: str | None = None) -> dict:
    param = param if param is not None else param_of(message)
    code = None
    if status == 404 and param == "model":
        code = "model_not_found"
    elif status == 429:
        code = "rate_limit_exceeded"
    kind = TYPE_OF_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(message: str, status: int, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status_code=status)


def validation_error_response(errors: list[dict], problems: list[str]) -> JSONResponse:
    """A body that failed validation: the first problem's field as `param`, written the way
    OpenAI names fields (messages[0].role)."""
    param = None
    if errors:
        param = ""
        for part in errors[0].get("loc", ()):
            if part == "body":
                continue
            param += f"[{part}]" if isinstance(part, int) else f"{'.' if param else ''}{part}"
    return error_response("invalid request: " + "; ".join(problems), 400, param or None)
