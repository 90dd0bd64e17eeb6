"""Failures of the infrastructure, not of the job: Redis or the object store unreachable, S3 asking
us to slow down, Redis out of memory (or busy, loading, a read-only replica), a disk full or over
its quota. Tasks retry these with backoff, for as long as they last, instead of failing a job whose
input is fine: space and memory come back, and the job then finishes.

A Redis error reply is classified by its code (the reply's first word), so a reply that says the
command itself is wrong (`WRONGTYPE`, `ERR unknown command`, `NOSCRIPT`…) is a bug and still counts
as an attempt.
"""

from __future__ import annotations

import errno
import re

from bulkinfer.jobs.settings import DEFAULT_RETRY_MAX_DELAY_S

# S3 error codes that mean "try again later".
RETRYABLE_S3_CODES = frozenset({"SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout", "500",
                                "502", "503", "504"})
# Redis replies that say the server cannot take the command now: out of memory, busy running a script,
# loading its data, a read-only replica, its primary or cluster down, a failover, unable to persist
# (MISCONF: its own disk is full), not enough replicas.
RETRYABLE_REDIS_CODES = frozenset({"OOM", "BUSY", "LOADING", "READONLY", "MASTERDOWN", "TRYAGAIN",
                                   "CLUSTERDOWN", "MISCONF", "NOREPLICAS"})
# The disk is full, or the user's quota is: space comes back when something is deleted.
RETRYABLE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
# A Lua script's call that failed quotes the reply inside "Error running script …: -OOM command …".
_SCRIPT_REPLY = re.compile(r"-([A-Z]+) ")
MAX_RETRY_DELAY_S = DEFAULT_RETRY_MAX_DELAY_S  # the `retry_max_delay_s` setting's default


def is_transient(error: BaseException) -> bool:
    """True when `error`, or an error it was raised from (`raise … from`), is an infrastructure fault."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if _is_transient_itself(current):
            return True
        seen.add(id(current))
        current = current.__cause__
    return False


def _is_transient_itself(error: BaseException) -> bool:
    import redis
    from botocore.exceptions import ClientError, HTTPClientError
    from botocore.exceptions import ConnectionError as BotoConnectionError

    if isinstance(error, redis.ConnectionError | redis.TimeoutError | BotoConnectionError | HTTPClientError
                  | ConnectionError | TimeoutError):
        return True
    if isinstance(error, redis.exceptions.OutOfMemoryError | redis.exceptions.ReadOnlyError
                  | redis.exceptions.TryAgainError | redis.exceptions.ClusterDownError):
        return True  # the reply's own classes (their message no longer starts with the code)
    if isinstance(error, redis.ResponseError):
        return redis_reply_code(error) in RETRYABLE_REDIS_CODES
    if isinstance(error, ClientError):
        return str(error.response.get("Error", {}).get("Code", "")) in RETRYABLE_S3_CODES
    if isinstance(error, OSError):
        return error.errno in RETRYABLE_ERRNOS
    return False


def redis_reply_code(error: BaseException) -> str:
    """The code of a Redis error reply ("OOM", "WRONGTYPE", "ERR"), or of the reply a failed script
    call quotes."""
    text = str(error)
    if text.startswith("Error running script"):
        quoted = _SCRIPT_REPLY.search(text)
        if quoted:
            return quoted.group(1)
    return str(getattr(error, "status_code", None) or text.split(" ", 1)[0])


def retry_delay_s(retries: int, most: float = MAX_RETRY_DELAY_S) -> float:
    """1, 2, 4, … seconds, at most `most` (the `retry_max_delay_s` setting; a minute by default): an
    outage of any length is waited out."""
    return float(min(most, 2 ** retries))
