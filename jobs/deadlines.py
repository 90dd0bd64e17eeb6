"""Deadlines: a job's `completion_window` ("24h" as OpenAI's batch files have it, or seconds).

A job with a window gets `expires_at` = created + window, and a place in a Redis sorted set of
deadlines. When the deadline passes, the rows not yet done become `expired` row errors: a running
shard aborts its rows still in the engine (worker/hosts/engine_rows.py), a shard that had not started is
written with every row expired by the expiry sweep (worker/shards/deadline_sweep.py), and once every shard
is in the job ends `expired`, with its finished rows, manifest and webhook.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the SDK validates specs (completion_window) and installs without redis
    import redis

UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
WINDOW_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
# The pattern above, for the published schema, with a number that is not zero.
WINDOW_SCHEMA_PATTERN = r"^\s*(\d*[1-9]\d*(\.\d+)?|\d+\.\d*[1-9]\d*)\s*[smhd]?\s*$"
DEFAULT_MAX_WINDOW = "7d"


def window_seconds(window: str | int | float) -> float:
    """Seconds in a window: `"24h"`, `"90m"`, `"3600s"`, `"2d"`, `"3600"` or a number of seconds.
    Raises `ValueError` saying what is wrong."""
    if isinstance(window, bool):
        raise ValueError(f"a completion_window is a duration such as '24h' or seconds, not {window!r}")
    if isinstance(window, int | float):
        seconds = float(window)
    else:
        match = WINDOW_PATTERN.match(window)
        if match is None:
            raise ValueError(f"completion_window {window!r} does not parse: give seconds or a number with "
                             "a unit s, m, h or d, such as '24h' or '90m'")
        seconds = float(match[1]) * UNIT_SECONDS[match[2] or "s"]
    if seconds <= 0:
        raise ValueError(f"completion_window {window!r} must be longer than zero")
    return seconds


def deadlines_key(namespace: str) -> str:
    return f"{namespace}:deadlines"


def register_deadline(client: redis.Redis, namespace: str, job_id: str, expires_at: datetime) -> None:
    client.zadd(deadlines_key(namespace), {job_id: expires_at.timestamp()})


def due_jobs(client: redis.Redis, namespace: str, now: datetime, limit: int = 100) -> list[str]:
    """Jobs whose deadline has passed (ended ones too, until `forget_deadline`), earliest first."""
    members = client.zrangebyscore(deadlines_key(namespace), "-inf", now.timestamp(), start=0, num=limit)
    return [member.decode() if isinstance(member, bytes) else str(member) for member in members]


def forget_deadline(client: redis.Redis, namespace: str, job_id: str) -> None:
    client.zrem(deadlines_key(namespace), job_id)


def is_past(expires_at: datetime | None, now: datetime) -> bool:
    return expires_at is not None and now >= expires_at
