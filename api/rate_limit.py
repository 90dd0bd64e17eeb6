"""Requests per second per API key (per tenant; admins and an open API count as one caller each).

A fixed one-second window in Redis (`INCR` on a key that expires after two seconds): cheap, shared
by every API process, and good enough to stop one client from starving the others. Beyond the
limit a request answers 429 with `Retry-After: 1`. The health check is never limited.
"""

from __future__ import annotations

import time

import redis
from fastapi import Request

from bulkinfer.api.auth import OPEN_PATHS, caller_of
from bulkinfer.api.errors import HttpError
from bulkinfer.jobs.names import rate_key


class RateLimit:
    def __init__(self, client: redis.Redis, namespace: str, per_second: int | None) -> None:
        self._client = client
        self._namespace = namespace
        self.per_second = per_second

    def __call__(self, request: Request) -> None:
        if self.per_second is None or request.url.path in OPEN_PATHS:
            return
        caller = caller_of(request)
        who = "admin" if caller.admin and caller.tenant is None else f"tenant:{caller.tenant}"
        key = rate_key(self._namespace, who, int(time.time()))
        with self._client.pipeline(transaction=False) as pipe:
            pipe.incr(key)
            pipe.expire(key, 2)
            count, _ = pipe.execute()
        if int(count) > self.per_second:
            raise HttpError(429, f"more than {self.per_second} requests in one second from this key "
                                "(max_requests_per_s); slow down and retry", headers={"Retry-After": "1"})
