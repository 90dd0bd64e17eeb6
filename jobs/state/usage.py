"""Usage by tenant and model over time, for `GET /usage` (and chargeback between teams).

When a shard is counted (once: jobs/state/counters.py, in the same atomic step), its rows, deduplicated
rows, tokens and the engine seconds attributed to it are added to an hourly bucket per (tenant,
model) in Redis; a report sums the buckets of a time range. So usage is counted when it happens,
whether the job later succeeds, fails, is cancelled or expires. Buckets are kept `RETENTION_DAYS`;
a time range is read to the hour.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

from pydantic import BaseModel, Field

from bulkinfer.jobs.names import NO_TENANT
from bulkinfer.jobs.state.results import ShardResult, TokenUsage

if TYPE_CHECKING:  # the SDK reads UsageReport and installs without redis
    import redis

RETENTION_DAYS = 400
MAX_RANGE_DAYS = 400
FIELDS = ("rows", "rows_failed", "rows_deduplicated", "shards", "tokens_prompt", "tokens_cached",
          "tokens_completion", "engine_ms")


class UsageLine(BaseModel):
    tenant: str | None = Field(description="None: jobs submitted without an API key")
    model: str
    shards: int = 0
    rows: int = 0
    rows_failed: int = 0
    rows_deduplicated: int = Field(0, description="rows that took an identical row's output, not computed")
    usage: TokenUsage = Field(default_factory=TokenUsage)


class UsageReport(BaseModel):
    since: datetime
    until: datetime
    lines: list[UsageLine] = Field(description="one per tenant and model with usage in the range")
    total: UsageLine


def _hour(at: datetime) -> str:
    return at.astimezone(UTC).strftime("%Y%m%d%H")


def _bucket_key(namespace: str, tenant: str, model: str, hour: str) -> str:
    return f"{namespace}:usage:{json.dumps([tenant, model])}:{hour}"


def _index_key(namespace: str) -> str:
    return f"{namespace}:usage:index"


@dataclass(frozen=True)
class UsageEntry:
    """What counting a shard adds to usage: increments to its hour's bucket (the hour it finished),
    the bucket's lifetime and its (tenant, model) in the index. `JobCounters.apply_shard` adds it in
    the same atomic step that counts the shard, so a shard's usage is added exactly when it is counted."""
    bucket_key: str
    increments: dict[str, int]
    ttl_s: int
    index_key: str
    index_member: str


def shard_usage_entry(namespace: str, tenant: str | None, model: str, result: ShardResult) -> UsageEntry:
    who = tenant or NO_TENANT
    increments = {"rows": result.rows, "rows_failed": result.rows_failed,
                  "rows_deduplicated": result.rows_deduplicated, "shards": 1,
                  "tokens_prompt": result.usage.prompt, "tokens_cached": result.usage.cached,
                  "tokens_completion": result.usage.completion,
                  "engine_ms": round(result.usage.engine_seconds * 1000)}
    return UsageEntry(bucket_key=_bucket_key(namespace, who, model, _hour(result.finished_at)),
                      increments=increments, ttl_s=RETENTION_DAYS * 86400,
                      index_key=_index_key(namespace), index_member=json.dumps([who, model]))


def usage_report(client: redis.Redis, namespace: str, since: datetime, until: datetime,
                 tenant: str | None = None, model: str | None = None) -> UsageReport:
    """Usage in [since, until) by hour buckets, per tenant and model; `tenant` and `model` narrow
    it (None: every one). Raises `ValueError` for an empty or too long range."""
    if until <= since:
        raise ValueError(f"until ({until.isoformat()}) must be after since ({since.isoformat()})")
    if until - since > timedelta(days=MAX_RANGE_DAYS):
        raise ValueError(f"a usage range may span at most {MAX_RANGE_DAYS} days")
    members = sorted(json.loads(member) for member in client.smembers(_index_key(namespace)))
    pairs = [(who, name) for who, name in members
             if (tenant is None or who == tenant) and (model is None or name == model)]
    hours = []
    at = since.astimezone(UTC).replace(minute=0, second=0, microsecond=0)
    while at < until:
        hours.append(_hour(at))
        at += timedelta(hours=1)
    sums: dict[tuple[str, str], dict[str, int]] = defaultdict(lambda: dict.fromkeys(FIELDS, 0))
    with client.pipeline(transaction=False) as pipeline:
        keys = [(pair, _bucket_key(namespace, *pair, hour)) for pair in pairs for hour in hours]
        for _, key in keys:
            pipeline.hgetall(key)
        for (pair, _), raw in zip(keys, pipeline.execute(), strict=True):
            for field, value in raw.items():
                name = field.decode() if isinstance(field, bytes) else field
                if name in FIELDS:
                    sums[pair][name] += int(value)
    lines = [_line(who, name, values) for (who, name), values in sorted(sums.items())
             if values["shards"]]
    total = dict.fromkeys(FIELDS, 0)
    for values in sums.values():
        for name in FIELDS:
            total[name] += values[name]
    return UsageReport(since=since, until=until, lines=lines, total=_line(tenant, model or "*", total))


def _line(tenant: str | None, model: str, values: dict[str, int]) -> UsageLine:
    return UsageLine(tenant=None if tenant == NO_TENANT else tenant, model=model,
                     shards=values["shards"], rows=values["rows"], rows_failed=values["rows_failed"],
                     rows_deduplicated=values["rows_deduplicated"],
                     usage=TokenUsage(prompt=values["tokens_prompt"], cached=values["tokens_cached"],
                                      completion=values["tokens_completion"],
                                      engine_seconds=values["engine_ms"] / 1000))
