"""The worker's Prometheus metrics (served by worker/process/status_server.py at /metrics).

Counters and histograms are updated where the work happens (a shard's rows and tokens, a task's
retry, a reaper re-send); the engines' own state (running and waiting requests, KV blocks, prefix
hits, preemptions, load time) is read from each loaded engine when Prometheus scrapes, between two
engine steps (worker/process/engine_metrics.py). Names follow Prometheus conventions: counters end in
`_total`, times in `_seconds`. One registry per process, not prometheus_client's global one, so that
a process that is also the API (`serve all`) or a test that builds many apps never registers a name
twice.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram

if TYPE_CHECKING:
    from bulkinfer.engine.outputs import RequestOutput
    from bulkinfer.jobs.state.results import ShardResult

# Nothing of the worker is imported here: the rows' code (worker/hosts/engine_rows.py) counts into
# this module, and the engines' own figures are read by worker/process/engine_metrics.py.
REGISTRY = CollectorRegistry()
# Batch latencies run from milliseconds (decode steps) to many minutes (a queued row's first token).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)

ROWS = Counter("bulkinfer_worker_rows", "Rows this worker finished, by outcome (succeeded, failed)",
               ["model", "outcome"], registry=REGISTRY)
TOKENS = Counter("bulkinfer_worker_tokens", "Tokens of the rows this worker finished: prompt, cached "
                 "(prompt tokens served by the prefix cache) and completion", ["model", "kind"],
                 registry=REGISTRY)
SHARDS = Counter("bulkinfer_worker_shards", "Shard runs by outcome (done, cancelled, failed, handed_back, "
                 "skipped)", ["model", "outcome"], registry=REGISTRY)
TTFT = Histogram("bulkinfer_time_to_first_token_seconds", "From a request entering the engine to its first "
                 "token", ["model"], buckets=LATENCY_BUCKETS, registry=REGISTRY)
TPOT = Histogram("bulkinfer_time_per_output_token_seconds", "A request's mean time between output tokens",
                 ["model"], buckets=LATENCY_BUCKETS, registry=REGISTRY)
TASK_RETRIES = Counter("bulkinfer_task_retries", "Plan, shard and finalize runs sent again, by step and "
                       "reason (transient: Redis or the store unreachable; error: anything else)",
                       ["step", "reason"], registry=REGISTRY)
REAPER_RESENDS = Counter("bulkinfer_reaper_resends", "Steps the reaper re-sent because their worker died",
                         ["step"], registry=REGISTRY)
STORE_ERRORS = Counter("bulkinfer_store_errors",
                       "Object-store calls that failed transiently (a task retried)", registry=REGISTRY)
REDIS_ERRORS = Counter("bulkinfer_redis_errors", "Redis calls that failed transiently (a task retried)",
                       registry=REGISTRY)


def record_shard(model: str, outcome: str, result: ShardResult | None = None) -> None:
    """One shard run ended; a run that wrote its result also counts its rows and tokens."""
    SHARDS.labels(model, outcome).inc()
    if result is None:
        return
    ROWS.labels(model, "succeeded").inc(result.rows - result.rows_failed)
    ROWS.labels(model, "failed").inc(result.rows_failed)
    for kind in ("prompt", "cached", "completion"):
        TOKENS.labels(model, kind).inc(getattr(result.usage, kind))


def record_requests(model: str, results: Iterable[RequestOutput]) -> None:
    """Each finished request's first-token and per-token latency."""
    for result in results:
        metrics = result.metrics
        if metrics is None:
            continue
        if metrics.time_to_first_token is not None:
            TTFT.labels(model).observe(metrics.time_to_first_token)
        if metrics.time_per_output_token is not None:
            TPOT.labels(model).observe(metrics.time_per_output_token)


def record_transient(error: BaseException) -> None:
    """A task retries because Redis or the store failed: count which one."""
    import redis
    from kombu.exceptions import OperationalError

    (REDIS_ERRORS if isinstance(error, redis.RedisError | OperationalError) else STORE_ERRORS).inc()
