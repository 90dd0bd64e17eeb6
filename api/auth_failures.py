"""Wrong API keys, limited per client address: a key cannot be guessed at request speed.

Each 401 answered to a request that carried an `Authorization` header counts against the address
it came from (as the API sees it: behind a proxy, the proxy's) in a one-minute window in Redis,
shared by every API process. Past `max_auth_failures_per_min` (default 30), keyed requests from
that address answer 429 with `Retry-After` (the seconds left in the minute), whatever key they
carry, so a guess made then cannot succeed. Valid keys are not affected: a request with a valid key
never counts, and a key that has authenticated from that address before (within the hour) goes on
working through the block, so a client sharing an address (a NAT) with a guesser keeps its service.
"""

from __future__ import annotations

import logging
import threading
import time

import redis

from bulkinfer.api.errors import HttpError
from bulkinfer.jobs.names import auth_failures_key, auth_known_key

logger = logging.getLogger(__name__)
WINDOW_S = 60
KNOWN_TTL_S = 3600
REMEMBER_EVERY_S = 300  # how often one process refreshes a known (address, key) in Redis


class AuthFailureLimit:
    def __init__(self, client: redis.Redis, namespace: str, per_minute: int) -> None:
        self._client = client
        self._namespace = namespace
        self.per_minute = per_minute
        self._remembered: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()

    def blocked(self, address: str) -> HttpError | None:
        """The 429 to answer while `address` is past the limit in this minute; None otherwise."""
        now = time.time()
        try:
            failures = int(self._client.get(auth_failures_key(self._namespace, address, int(now // WINDOW_S)))
                           or 0)
        except redis.RedisError:  # without Redis no count: keys are still checked
            logger.warning("cannot read the wrong-key count of %s", address, exc_info=True)
            return None
        if failures < self.per_minute:
            return None
        wait = max(1, int(WINDOW_S - now % WINDOW_S + 0.999))
        return HttpError(429, f"too many requests with a wrong API key from this address ({failures} this "
                              f"minute, the max_auth_failures_per_min limit); retry in {wait} s",
                         headers={"Retry-After": str(wait)})

    def record(self, address: str) -> None:
        """Count one wrong key from `address`."""
        key = auth_failures_key(self._namespace, address, int(time.time() // WINDOW_S))
        try:
            with self._client.pipeline(transaction=False) as pipe:
                pipe.incr(key)
                pipe.expire(key, 2 * WINDOW_S)
                pipe.execute()
        except redis.RedisError:
            logger.warning("cannot count a wrong key from %s", address, exc_info=True)

    def known(self, address: str, digest: str) -> bool:
        """Whether this key authenticated from `address` within the hour."""
        try:
            return bool(self._client.sismember(auth_known_key(self._namespace, address), digest))
        except redis.RedisError:
            return False

    def remember(self, address: str, digest: str) -> None:
        """Note a key that authenticated from `address` (in Redis at most every few minutes per process)."""
        now = time.time()
        with self._lock:
            if now - self._remembered.get((address, digest), 0.0) < REMEMBER_EVERY_S:
                return
            if len(self._remembered) > 10_000:
                self._remembered.clear()
            self._remembered[(address, digest)] = now
        key = auth_known_key(self._namespace, address)
        try:
            with self._client.pipeline(transaction=False) as pipe:
                pipe.sadd(key, digest)
                pipe.expire(key, KNOWN_TTL_S)
                pipe.execute()
        except redis.RedisError:
            logger.warning("cannot note a valid key from %s", address, exc_info=True)
