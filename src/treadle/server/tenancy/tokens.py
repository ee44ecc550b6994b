"""Short-lived tokens for API keys (POST /api/v1/auth/token: the tinker SDK's pjwt exchange,
on when the server's jwt_auth is): a JWT (HS256, under a secret made when the app starts,
so a restart ends every token) that stands for the key that asked for it, until it expires.

A token names its key by the key's hash, never the key: each request with a token is
checked against that key as the key itself would be (revoked → 401 within the auth
cache's TTL), and counts against the key's spend caps. Its claims are what the SDK reads
for `whoami`: `sub` (the tenant's owner URN), `org_id` (the tenant's id).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import jwt

from treadle.errors import AuthError

ISSUER = "treadle"
PREFIX = "eyJ"  # how a JWT starts (the SDK sends one as X-API-Key)


@dataclass(frozen=True)
class TokenClaims:
    key_hash: str
    key_id: str
    tenant_id: str


class TokenIssuer:
    def __init__(self, ttl_s: float, secret: bytes | None = None):
        self.ttl_s = ttl_s
        self._secret = secret or os.urandom(32)

    def issue(self, key_hash: str, key_id: str, tenant_id: str) -> str:
        now = int(time.time())
        claims = {
            "iss": ISSUER,
            "sub": f"treadle:tenant:{tenant_id}",
            "org_id": tenant_id,
            "kh": key_hash,
            "kid": key_id,
            "iat": now,
            "exp": now + int(self.ttl_s),
        }
        return jwt.encode(claims, self._secret, algorithm="HS256")

    def read(self, token: str) -> TokenClaims:
        """The claims of a token this server issued and that has not expired; AuthError
        otherwise (the SDK exchanges its key again on a 401 that says invalid_token)."""
        try:
            claims = jwt.decode(token, self._secret, algorithms=["HS256"], issuer=ISSUER)
        except jwt.ExpiredSignatureError as e:
            raise AuthError("token expired: exchange the API key again (auth/token)") from e
        except jwt.PyJWTError as e:
            raise AuthError(f"token not recognised by this server ({e})") from e
        return TokenClaims(claims["kh"], claims["kid"], claims["org_id"])


def is_token(key: str | None) -> bool:
    return key is not None and key.startswith(PREFIX)


def unverified_key_id(token: str) -> str | None:
    """The key id a token names, without checking it (a label only)."""
    try:
        kid = jwt.decode(token, options={"verify_signature": False}).get("kid")
    except jwt.PyJWTError:
        return None
    return kid if isinstance(kid, str) else None
