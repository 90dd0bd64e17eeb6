"""Bounded retries for a job's steps that fail for reasons of their own.

Infrastructure failures (Redis or the store unreachable) are retried for as long as they last
(`worker/transient.py`). Any other exception in a plan, shard or finalize run is counted per job
and step in Redis; the step is retried with backoff until it has failed `max_task_attempts` times
(a setting, default 3), then the job fails with the step and its last error in the message. So a
shard that always fails the same way ends its job with a reason instead of being re-sent forever.
"""

from __future__ import annotations

import redis

from bulkinfer.jobs.names import failures_key

DEFAULT_MAX_ATTEMPTS = 3
COUNT_TTL_S = 7 * 24 * 3600  # as long as Celery keeps task results


def record_failure(client: redis.Redis, namespace: str, job_id: str, step: str) -> int:
    """Count one more failure of `step` ("plan", "shard 3", "finalize"); returns the count so far."""
    key = failures_key(namespace, job_id, step)
    with client.pipeline(transaction=True) as pipe:
        pipe.incr(key)
        pipe.expire(key, COUNT_TTL_S)
        count, _ = pipe.execute()
    return int(count)


def failure_message(step: str, attempts: int, error: BaseException) -> str:
    """Why the job failed, for the user: the step, how often it failed, and the last error."""
    text = str(error).strip() or "no message"
    if len(text) > 500:
        text = text[:500] + "…"
    return f"{step} failed {attempts} time(s); last error: {type(error).__name__}: {text}"
