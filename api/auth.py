"""API keys: with `api_keys` set (BULKINFER_API_KEYS), every route but the health check needs
`Authorization: Bearer <one of the keys>`. Unset, the API is open, for a trusted network.

Keys are compared in constant time; a refusal is a 401 that says what was wrong (no header, not a
Bearer token, an unknown key) and never echoes the key it was given.
"""

from __future__ import annotations

import hmac

from fastapi import Request

from api.errors import ApiError

OPEN_PATHS = frozenset({"/healthz"})


class ApiKeyCheck:
    """A FastAPI dependency for the whole app."""

    def __init__(self, keys: list[str]) -> None:
        self._keys = [key.encode() for key in keys]

    def __call__(self, request: Request) -> None:
        if not self._keys or request.url.path in OPEN_PATHS:
            return
        header = request.headers.get("authorization")
        if not header:
            raise _unauthorized("this API needs an API key: send 'Authorization: Bearer <key>' "
                                "(the SDK's api_key=, the CLI's --api-key or $BULKINFER_API_KEY)")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise _unauthorized("the Authorization header must be 'Bearer <key>'")
        given = token.strip().encode()
        # Every key is compared, so the time taken says nothing about which one came close.
        if not any([hmac.compare_digest(given, key) for key in self._keys]):
            raise _unauthorized("the API key is not valid")


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, message, headers={"WWW-Authenticate": "Bearer"})
