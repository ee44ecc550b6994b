"""Errors, rooted at one base class. Each also subclasses the stdlib type it replaces.

The server maps them to HTTP in one place: InvalidRequestError → 400, NotFoundError → 404,
ConflictError → 409, QuotaExceededError → 429; anything else is a server error.
"""


class TreadleError(Exception):
    """Base of every error Treadle raises on purpose."""


class InvalidRequestError(TreadleError, ValueError):
    """The caller sent something wrong; the message names the field and the expected value."""


class NotFoundError(TreadleError, LookupError):
    """A model, session, request or checkpoint that does not exist (or is not yours)."""


class ConflictError(TreadleError):
    """The request clashes with the current state (e.g. a checkpoint name already taken)."""


class QuotaExceededError(TreadleError):
    """Over a quota or a rate limit; the message names the quota."""


class EngineDeadError(TreadleError, RuntimeError):
    """The engine cannot serve any request any more (as opposed to one request failing)."""
