"""The worker's Prometheus metrics (served by worker/status_server.py at /metrics).

Counters and histograms are updated where the work happens (a shard's rows and tokens, a task's
retry, a reaper re-send); the engines' own state (running and waiting requests, KV blocks, prefix
hits, preemptions, load time) is read from each loaded engine when Prometheus scrapes, between two
engine steps. Names follow Prometheus conventions: counters end in `_total`, times in `_seconds`.
One registry per process, not prometheus_client's global one, so that a process that is also the
API (`serve all`) or a test that builds many apps never registers a name twice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from worker.embed_host import EmbedHost
from worker.kv_metrics import KVStoreCollector

if TYPE_CHECKING:
    from engine.outputs import RequestOutput
    from jobs.results import ShardResult
    from worker.model_hosts import HostedModel

logger = logging.getLogger(__name__)

REGISTRY = CollectorRegistry()
ENGINE_SCRAPE_TIMEOUT_S = 5.0  # one engine step at most, normally well under a second
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


# Engine figures read at scrape time: (name, help, key of LLMEngine.get_metrics()).
ENGINE_GAUGES = (
    ("bulkinfer_engine_running_requests", "Requests the engine is running", "num_running"),
    ("bulkinfer_engine_waiting_requests", "Requests waiting to be scheduled", "num_waiting"),
    ("bulkinfer_engine_kv_blocks_used", "KV-cache blocks in use", "kv_blocks_used"),
    ("bulkinfer_engine_kv_blocks_total", "KV-cache blocks the engine has", "kv_blocks_total"),
    ("bulkinfer_engine_prefix_cache_hit_ratio", "Prompt blocks served by the prefix cache over blocks "
     "looked up, since the engine started", "prefix_cache_hit_rate"),
)
ENGINE_COUNTERS = (
    ("bulkinfer_engine_preemptions", "Requests preempted (KV blocks ran out; recomputed later)",
     "num_preemptions"),
    ("bulkinfer_engine_steps", "Engine steps", "num_steps"),
    ("bulkinfer_engine_busy_seconds", "Seconds the engine spent stepping", "busy_time_s"),
    ("bulkinfer_engine_generation_tokens", "Tokens the engine sampled", "generation_tokens"),
)

# Speculative decoding, when the engine has it: (name, help, key of get_metrics()["speculative_decoding"]).
SPECULATION_COUNTERS = (
    ("bulkinfer_engine_spec_draft_tokens", "Draft tokens verified (speculative decoding)",
     "num_draft_tokens"),
    ("bulkinfer_engine_spec_accepted_tokens", "Draft tokens accepted (speculative decoding)",
     "num_accepted_tokens"),
    ("bulkinfer_engine_spec_verifications", "Request-steps that verified drafts", "num_verifications"),
)


class EngineCollector:
    """Reads every loaded engine's figures when scraped; `models()` lists the worker's hosted models."""

    def __init__(self, models: Callable[[], Sequence[HostedModel]]) -> None:
        self._models = models

    def collect(self) -> Iterator[Metric]:
        gauges = {name: GaugeMetricFamily(name, text, labels=["model"]) for name, text, _ in ENGINE_GAUGES}
        counters = {name: CounterMetricFamily(name, text, labels=["model"])
                    for name, text, _ in ENGINE_COUNTERS + SPECULATION_COUNTERS}
        loaded = GaugeMetricFamily("bulkinfer_engine_loaded",
                                   "1 once the model's engine is loaded and healthy", labels=["model"])
        load_seconds = GaugeMetricFamily("bulkinfer_engine_load_seconds", "Seconds the engine took to load",
                                         labels=["model"])
        info = GaugeMetricFamily("bulkinfer_engine_info", "The engine's compute dtype and device (always 1)",
                                 labels=["model", "dtype", "device"])
        for hosted in self._models():
            host = hosted.host
            healthy = host.loaded and host.failure is None
            loaded.add_metric([hosted.name], 1.0 if healthy else 0.0)
            if host.load_seconds is not None:
                load_seconds.add_metric([hosted.name], host.load_seconds)
            if not healthy:
                continue
            choice = host.dtype_choice
            info.add_metric([hosted.name, choice.dtype if choice else "", host.device or ""], 1.0)
            if isinstance(host, EmbedHost):  # an embedder has no scheduler or KV cache to report
                continue
            figures = engine_figures(hosted)
            if figures is None:
                continue
            for name, _, key in ENGINE_GAUGES:
                gauges[name].add_metric([hosted.name], float(figures[key]))
            for name, _, key in ENGINE_COUNTERS:
                counters[name].add_metric([hosted.name], float(figures[key]))
            speculation = figures.get("speculative_decoding")
            for name, _, key in SPECULATION_COUNTERS if speculation else ():
                counters[name].add_metric([hosted.name], float(speculation[key]))
        yield from (*gauges.values(), *counters.values(), loaded, load_seconds, info)


def engine_figures(hosted: HostedModel) -> dict[str, Any] | None:
    """The engine's `get_metrics()`, asked between two steps; None when it does not answer in time."""
    if isinstance(hosted.host, EmbedHost):  # its own counters, read without waiting for a pass
        return hosted.host.figures()
    try:
        return hosted.host.call(lambda engine: engine.get_metrics(), timeout=ENGINE_SCRAPE_TIMEOUT_S)
    except Exception as error:  # noqa: BLE001 - a busy or dying engine leaves its figures out of this scrape
        logger.warning("metrics: engine %s did not answer: %s", hosted.name, error)
        return None


def register_engines(models: Callable[[], Sequence[HostedModel]]) -> None:
    """Add the engines' figures, and their prefix KV tier's, to the registry (once per process)."""
    REGISTRY.register(EngineCollector(models))
    REGISTRY.register(KVStoreCollector(models))
