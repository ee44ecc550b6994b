"""What to do about the mistakes a newcomer makes first: the hint each of their errors ends
with (and which makes an uncaught one a single line: treadle.client.excepthook).

- nothing answers at the base URL, or something that is not a treadle server does;
- the server wants an API key, or does not know the one sent;
- the base model is not one the server serves (the server's message lists those it does).
"""

from __future__ import annotations

from treadle.client.errors import (
    APIConnectionError,
    APIError,
    AuthenticationError,
    BadRequestError,
    NotFoundError,
)


def reaching(error: APIError, base_url: str) -> APIError:
    """The first call to the server failed (ServiceClient()): why, and what to do."""
    if isinstance(error, APIConnectionError):
        return error.with_hint(
            f"no treadle server answers at {base_url}: start one with `treadle serve "
            "--model NAME=PATH`, or pass base_url= (or set TREADLE_BASE_URL) to the address "
            "it printed"
        )
    if isinstance(error, NotFoundError):
        return error.with_hint(
            f"{base_url} does not look like a treadle server's address: give the address "
            "`treadle serve` printed (http://HOST:PORT, no path)"
        )
    if isinstance(error, AuthenticationError):
        return error.with_hint(
            "pass api_key= to ServiceClient (or set TREADLE_API_KEY) to a key of this "
            "server; its admin makes one with `treadle admin create-key TENANT`"
        )
    return error


def model_choice(error: APIError) -> APIError:
    """A base model the server does not serve (its message lists the served ones)."""
    if isinstance(error, BadRequestError) and "is not served here" in error.message:
        return error.with_hint(
            "pass one of the served names (ServiceClient.list_base_models() lists them)"
        )
    return error
