"""Failures of the infrastructure, not of the job: Redis or the object store unreachable, S3 asking
us to slow down. Tasks retry these with backoff instead of failing a job whose input is fine.
"""

from __future__ import annotations

# S3 error codes that mean "try again later".
RETRYABLE_S3_CODES = frozenset({"SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout", "500",
                                "502", "503", "504"})
MAX_RETRY_DELAY_S = 60


def is_transient(error: BaseException) -> bool:
    import redis
    from botocore.exceptions import ClientError, HTTPClientError
    from botocore.exceptions import ConnectionError as BotoConnectionError

    if isinstance(error, redis.ConnectionError | redis.TimeoutError | BotoConnectionError | HTTPClientError
                  | ConnectionError | TimeoutError):
        return True
    if isinstance(error, ClientError):
        return str(error.response.get("Error", {}).get("Code", "")) in RETRYABLE_S3_CODES
    return False


def retry_delay_s(retries: int) -> float:
    """1, 2, 4, … seconds, at most a minute: an outage of any length is waited out."""
    return float(min(MAX_RETRY_DELAY_S, 2 ** retries))
