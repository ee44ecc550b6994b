"""Signed download links: the signature is the grant, not an API key.

A token is the base64 of its claims (the checkpoint and an expiry) and an HMAC of them
under a secret made when the app starts (a restart invalidates every link).
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import hashlib
import hmac
import json
import os
from typing import Any

from treadle.errors import NotFoundError

URL_TTL_S = 3600


class Signer:
    def __init__(self, secret: bytes | None = None):
        self._secret = secret or os.urandom(32)

    def sign(self, claims: dict[str, Any]) -> str:
        body = base64.urlsafe_b64encode(json.dumps(claims).encode()).decode().rstrip("=")
        return f"{body}.{self._mac(body)}"

    def verify(self, token: str, claim: str = "path") -> dict[str, Any]:
        """The claims of a valid, unexpired token that grants `claim` (a checkpoint's
        "path", an "upload", a "trace"); NotFoundError otherwise (whatever the token holds:
        it comes from anyone who has a URL)."""
        body, _, mac = token.partition(".")
        if not mac.isascii() or not hmac.compare_digest(mac.encode(), self._mac(body).encode()):
            raise NotFoundError("download link: invalid signature")
        try:
            claims = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
        except (ValueError, binascii.Error) as e:
            raise NotFoundError("download link: invalid token") from e
        if not isinstance(claims, dict) or claim not in claims or "exp" not in claims:
            raise NotFoundError("signed link: not a link of this kind")
        if claims["exp"] < dt.datetime.now(dt.UTC).timestamp():
            raise NotFoundError("signed link: expired; ask for a new one")
        return claims

    def _mac(self, body: str) -> str:
        return hmac.new(self._secret, body.encode(), hashlib.sha256).hexdigest()[:32]
