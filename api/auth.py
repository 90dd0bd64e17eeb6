"""API keys and the tenants they belong to.

With `api_keys` set (BULKINFER_API_KEYS, or the config file's `api_keys`), every route but the
health check needs `Authorization: Bearer <key>` (or `x-api-key: <key>`, as Anthropic's SDK sends
it). Unset, the API is open, for a trusted network, and every caller sees everything.

`api_keys` is a comma-separated list of `tenant=key` (a bare `key` belongs to the tenant
`default`); a key may be given as `sha256:<hex digest of the key>` instead, so a config file need
not hold the keys themselves. `admin_api_keys` (same forms, no tenant) are admin keys: an admin
sees and acts on every tenant's jobs and schedules. Every job and schedule belongs to the tenant
whose key created it; another tenant's key gets 404 for it and never sees it in a list.

Keys are compared as sha256 digests in constant time, against every key; a refusal is a 401 that
says what was wrong (no header, not a Bearer token, an unknown key) and never echoes the key.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from bulkinfer.api.auth_failures import AuthFailureLimit
from bulkinfer.api.errors import HttpError
from bulkinfer.jobs.settings import ConfigError

OPEN_PATHS = frozenset({"/healthz", "/ui"})  # /ui: a static shell; its data comes through keyed calls
DEFAULT_TENANT = "default"
TENANT_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
HASH_PREFIX = "sha256:"


@dataclass(frozen=True)
class Caller:
    """Who is calling: a tenant, or an admin (or anyone, on an open API: `tenant` None)."""

    tenant: str | None
    admin: bool = False

    def sees(self, owner: str | None) -> bool:
        """Whether this caller may see and act on what `owner` created."""
        return self.admin or self.tenant is None or owner == self.tenant

    @property
    def scope(self) -> str | None:
        """The tenant a listing is limited to (None: every tenant)."""
        return None if self.admin else self.tenant


OPEN = Caller(tenant=None, admin=True)


def _digest(entry: str) -> str:
    """The hex sha256 of a key, given as the key or as `sha256:<hex>`."""
    if entry.startswith(HASH_PREFIX):
        digest = entry[len(HASH_PREFIX):].strip().lower()
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise ConfigError(f"api key {entry[:16]}…: a sha256: key needs 64 hex digits")
        return digest
    return hashlib.sha256(entry.encode()).hexdigest()


def parse_keys(api_keys: str | None, admin_api_keys: str | None = None) -> list[tuple[str, Caller]]:
    """(digest, caller) for every configured key; ConfigError naming a malformed entry."""
    keys: list[tuple[str, Caller]] = []
    for entry in filter(None, (part.strip() for part in (api_keys or "").split(","))):
        tenant, sep, key = entry.partition("=")
        if not sep:
            tenant, key = DEFAULT_TENANT, entry
        tenant, key = tenant.strip(), key.strip()
        if not re.match(TENANT_PATTERN, tenant) or not key:
            raise ConfigError(f"api_keys entry {tenant[:64]!r}=…: expected tenant=key, a tenant being "
                              "1-64 letters, digits, '.', '_' or '-'")
        keys.append((_digest(key), Caller(tenant=tenant)))
    for entry in filter(None, (part.strip() for part in (admin_api_keys or "").split(","))):
        keys.append((_digest(entry), Caller(tenant=None, admin=True)))
    return keys


class ApiKeyCheck:
    """A FastAPI dependency for the whole app; `caller(request)` says who sent a request."""

    def __init__(self, keys: list[tuple[str, Caller]], failures: AuthFailureLimit | None = None) -> None:
        self._keys = [(digest.encode(), caller) for digest, caller in keys]
        self._failures = failures  # wrong keys per client address (api/auth_failures.py)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def __call__(self, request: Request) -> None:
        request.state.caller = self.caller(request)

    def caller(self, request: Request) -> Caller:
        if not self._keys or request.url.path in OPEN_PATHS:
            return OPEN
        header = request.headers.get("authorization")
        if not header and request.headers.get("x-api-key"):  # Anthropic's SDK sends its key so
            header = f"Bearer {request.headers['x-api-key']}"
        if not header or self._failures is None:
            return self._check(header)[0]
        # An address past its wrong-key limit gets 429 whatever it sends, unless the key is one it
        # used successfully before: so a guess then cannot succeed, and a known client goes on.
        address = request.client.host if request.client else "unknown"
        blocked = self._failures.blocked(address)
        try:
            caller, digest = self._check(header)
        except HttpError as error:
            if blocked is not None:
                raise blocked from None
            if error.status_code == 401:
                self._failures.record(address)
            raise
        if blocked is not None and not self._failures.known(address, digest):
            raise blocked
        self._failures.remember(address, digest)
        return caller

    def _check(self, header: str | None) -> tuple[Caller, str]:
        """(who, the key's digest); 401 saying what was wrong."""
        if not header:
            raise _unauthorized("this API needs an API key: send 'Authorization: Bearer <key>' or "
                                "'x-api-key: <key>' (the SDK's api_key=, the CLI's --api-key or "
                                "$BULKINFER_API_KEY)")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise _unauthorized("the Authorization header must be 'Bearer <key>'")
        given = hashlib.sha256(token.strip().encode()).hexdigest().encode()
        # Every key is compared, so the time taken says nothing about which one came close.
        matches = [caller for digest, caller in self._keys if hmac.compare_digest(given, digest)]
        if not matches:
            raise _unauthorized("the API key is not valid")
        return matches[0], given.decode()


def caller_of(request: Request) -> Caller:
    caller = getattr(request.state, "caller", None)
    return caller if caller is not None else request.app.state.auth.caller(request)


CallerDep = Annotated[Caller, Depends(caller_of)]


def _unauthorized(message: str) -> HttpError:
    return HttpError(401, message, headers={"WWW-Authenticate": "Bearer"})
