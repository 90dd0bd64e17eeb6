"""The engines' own figures in the worker's metrics: running and waiting requests, KV blocks, prefix
hits, preemptions, load time, read from each loaded engine when Prometheus scrapes, between two
engine steps. Apart from worker/process/metrics.py (the counters the work updates), so that the rows'
code counts into those without importing the engine hosts back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from bulkinfer.worker.hosts.embed_host import EmbedHost
from bulkinfer.worker.kv.metrics import KVStoreCollector
from bulkinfer.worker.process.metrics import REGISTRY

if TYPE_CHECKING:
    from bulkinfer.worker.hosts.model_hosts import HostedModel

logger = logging.getLogger(__name__)

ENGINE_SCRAPE_TIMEOUT_S = 5.0  # one engine step at most, normally well under a second

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
            speculation = figures.get("speculative_decoding") or {}
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
    """Add the engines' figures to the registry (once per process)."""
    REGISTRY.register(EngineCollector(models))
    REGISTRY.register(KVStoreCollector(models))
