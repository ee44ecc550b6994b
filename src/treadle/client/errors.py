"""Errors the SDK raises for what the server said, rooted at `treadle.errors.TreadleError`.

Each HTTP status class also subclasses the matching `treadle.errors` type, so a loop that
catches `InvalidRequestError` catches a bad request whether our own validation or the server
found it. Every error keeps the server's message verbatim and stays picklable (the args that
rebuild it are the args it was made with).
"""

from __future__ import annotations

import json
from typing import Any

from treadle import errors


class APIError(errors.TreadleError):
    """Something went wrong talking to the server.

    `hint` (set on the mistakes a newcomer makes first: no server at that address, a wrong
    API key, a model the server does not serve) says what to do; such an error, uncaught,
    ends a script with one line rather than a traceback (treadle.client.excepthook)."""

    hint: str | None = None

    def with_hint(self, hint: str) -> APIError:
        """This error, its message ending with what to do."""
        self.hint = hint
        self.args = (f"{self.args[0]}; {hint}" if self.args else hint, *self.args[1:])
        return self


class APIConnectionError(APIError, ConnectionError):
    """The server could not be reached (after all retries)."""


class APIStatusError(APIError):
    """The server answered with an HTTP error status; `message` is the server's own text."""

    def __init__(self, message: str, status_code: int, body: Any = None):
        super().__init__(f"HTTP {status_code}: {message}")
        self.message = message
        self.status_code = status_code
        self.body = body

    def __reduce__(self) -> tuple:
        return (self.__class__, (self.message, self.status_code, self.body))


class BadRequestError(APIStatusError, errors.InvalidRequestError):
    """400/422: the request was malformed; the message names the field."""


class AuthenticationError(APIStatusError, PermissionError):
    """401/403: missing or wrong API key."""


class NotFoundError(APIStatusError, errors.NotFoundError):
    """404: no such model, session, request or checkpoint (or not yours)."""


class ConflictError(APIStatusError, errors.ConflictError):
    """409: the request clashes with the current state (e.g. a name already taken)."""


class GoneError(APIStatusError):
    """410: the session or future expired."""


class RateLimitError(APIStatusError, errors.QuotaExceededError):
    """429: over a rate limit or quota (raised only once retries give up)."""


class InternalServerError(APIStatusError, RuntimeError):
    """5xx: the server failed (raised only once retries give up)."""


class RequestFailedError(APIError, RuntimeError):
    """A future finished in a failed state; `category` is "user", "server" or "unknown"."""

    def __init__(self, message: str, request_id: str, category: str = "unknown"):
        super().__init__(f"{message} (request {request_id}, category {category})")
        self.message = message
        self.request_id = request_id
        self.category = category

    def __reduce__(self) -> tuple:
        return (self.__class__, (self.message, self.request_id, self.category))


_BY_STATUS: dict[int, type[APIStatusError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    403: AuthenticationError,
    404: NotFoundError,
    409: ConflictError,
    410: GoneError,
    422: BadRequestError,
    429: RateLimitError,
}


def server_message(body: Any, text: str = "") -> str:
    """The human message inside an error body, whichever of the common shapes it has."""
    if isinstance(body, dict):
        for key in ("detail", "error", "message"):
            value = body.get(key)
            if isinstance(value, str):
                return value
            if value is not None:
                # FastAPI's validation errors: a list of {loc, msg, type}
                return json.dumps(value)
        return json.dumps(body)
    return text or "(empty body)"


def status_error(status_code: int, body: Any, text: str = "") -> APIStatusError:
    """The typed exception for an HTTP error status."""
    cls = _BY_STATUS.get(status_code)
    if cls is None:
        cls = InternalServerError if status_code >= 500 else APIStatusError
    return cls(server_message(body, text), status_code, body)
