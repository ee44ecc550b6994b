"""Errors, rooted at one base class. Each also subclasses the stdlib type it replaces.

Each class carries its HTTP status and its category ("user": the caller can fix it;
"server": ours), so the server maps any of them to a response in one place, and an error
that crossed a thread or process boundary as `ErrorInfo` is raised again as its own class.
Every error pickles (its args rebuild it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

Category = Literal["user", "server"]


class TreadleError(Exception):
    """Base of every error Treadle raises on purpose."""

    status: ClassVar[int] = 500
    category: ClassVar[Category] = "server"

    @property
    def http_headers(self) -> dict[str, str]:
        """Extra response headers (a quota's Retry-After)."""
        return {}


class InvalidRequestError(TreadleError, ValueError):
    """The caller sent something wrong; the message names the field and the expected value."""

    status, category = 400, "user"


class PayloadTooLargeError(InvalidRequestError):
    """A request body over the server's size limit (413); the message names the limit."""

    status = 413


class AuthError(TreadleError, PermissionError):
    """A request whose API key is missing, unknown or revoked (401)."""

    status, category = 401, "user"


class ForbiddenError(AuthError):
    """A valid key that may not do this (an operator's endpoint, for a tenant's key)."""

    status = 403


class NotFoundError(TreadleError, LookupError):
    """A model, session, request or checkpoint that does not exist (or is not yours)."""

    status, category = 404, "user"


class SessionGoneError(NotFoundError):
    """The session ended (closed or silent too long); 410."""

    status = 410


class ConflictError(TreadleError):
    """The request clashes with the current state (e.g. a checkpoint name already taken)."""

    status, category = 409, "user"


class QuotaExceededError(TreadleError):
    """Over a quota or a rate limit (429); the message names the quota.

    `retry_after_s` None: asking again cannot help (the SDKs are told not to retry).
    """

    status, category = 429, "user"

    def __init__(self, message: str = "", retry_after_s: float | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def __reduce__(self) -> tuple:
        return (self.__class__, (str(self), self.retry_after_s))

    @property
    def http_headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {"x-should-retry": "false"}
        return {"Retry-After": str(max(1, -int(-self.retry_after_s // 1)))}


class StorageQuotaError(QuotaExceededError):
    """A save over the tenant's storage quota (403: waiting does not free storage; deleting
    checkpoints or setting their TTL does)."""

    status = 403


class RequestCancelledError(TreadleError):
    """The request was cancelled (cancel_future, or its stream's client went away)."""

    status, category = 409, "user"


class EngineDeadError(TreadleError, RuntimeError):
    """The engine cannot serve any request any more (as opposed to one request failing)."""

    status = 503


class DeviceFaultError(TreadleError, RuntimeError):
    """The request was running each time its engine's device failed, each time in a fresh
    worker process (treadle.protocol.faults): it is not run again."""

    status = 500


def _subclasses(cls: type[TreadleError]) -> list[type[TreadleError]]:
    out = [cls]
    for sub in cls.__subclasses__():
        out += _subclasses(sub)
    return out


@dataclass(frozen=True)
class ErrorInfo:
    """An error as plain data: what a failed future records and what crosses a boundary.

    `type` is the class name of a TreadleError (or of the exception that escaped), so
    `to_exception()` raises the same class on the other side.
    """

    type: str
    message: str
    category: Category = "server"

    @classmethod
    def of(cls, exc: BaseException) -> ErrorInfo:
        if isinstance(exc, TreadleError):
            return cls(type(exc).__name__, str(exc), exc.category)
        return cls(type(exc).__name__, f"{type(exc).__name__}: {exc}", "server")

    def to_exception(self) -> TreadleError:
        for cls in _subclasses(TreadleError):
            if cls.__name__ == self.type and cls.__module__ == __name__:
                return cls(self.message)
        return TreadleError(self.message)

    def to_json(self) -> dict[str, str]:
        """The body of a failed future (`{"error", "category"}`, what the SDKs read)."""
        return {"error": self.message, "category": self.category}
