"""The prefix KV tier's figures on the worker's /metrics: each engine's `kv_store_stats()` counters
(engine/kv_connector/stats.py), read between two of its steps when Prometheus scrapes. Engines
without the tier (kv_store off, embedders) report nothing here."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from bulkinfer.worker.hosts.engine_host import EngineHost

if TYPE_CHECKING:
    from bulkinfer.engine import LLMEngine
    from bulkinfer.worker.hosts.model_hosts import HostedModel

logger = logging.getLogger(__name__)

KV_SCRAPE_TIMEOUT_S = 5.0
# (name, help, key of kv_store_stats()); counters get `_total` in the exposition.
KV_COUNTERS = (
    ("bulkinfer_kv_store_hit_blocks", "Prefix KV blocks loaded from the object store", "hits_blocks"),
    ("bulkinfer_kv_store_miss_blocks", "Prefix KV blocks looked up in the object store and absent",
     "misses_blocks"),
    ("bulkinfer_kv_store_loaded_bytes", "KV bytes loaded from the object store", "loaded_bytes"),
    ("bulkinfer_kv_store_saved_bytes", "KV bytes saved to the object store", "saved_bytes"),
    ("bulkinfer_kv_store_saved_blocks", "KV blocks saved to the object store", "saved_blocks"),
    ("bulkinfer_kv_store_load_seconds", "Seconds spent loading KV blocks (beside the forward pass)",
     "load_seconds"),
    ("bulkinfer_kv_store_failed_loads", "KV loads that failed or timed out (the blocks were computed)",
     "failed_loads"),
    ("bulkinfer_kv_store_corrupt_blocks", "Stored KV blocks whose checksum failed (deleted, computed)",
     "corrupt_blocks"),
    ("bulkinfer_kv_store_failed_saves", "KV blocks whose save failed (the store down: not stored)",
     "failed_saves"),
)
STORED_BYTES = ("bulkinfer_kv_store_stored_bytes", "KV bytes stored in this engine's namespace",
                "stored_bytes")


def _stats(engine: LLMEngine) -> dict[str, Any] | None:
    return engine.kv_store_stats() if engine.config.kv_store is not None else None


class KVStoreCollector:
    """Reads every loaded engine's KV-tier counters when scraped; `models()` lists the hosted models."""

    def __init__(self, models: Callable[[], Sequence[HostedModel]]) -> None:
        self._models = models

    def collect(self) -> Iterator[Metric]:
        counters = {name: CounterMetricFamily(name, text, labels=["model"]) for name, text, _ in KV_COUNTERS}
        stored = GaugeMetricFamily(STORED_BYTES[0], STORED_BYTES[1], labels=["model"])
        for hosted in self._models():
            host = hosted.host
            if not isinstance(host, EngineHost) or not host.loaded or host.failure is not None:
                continue
            try:
                stats = host.call(_stats, timeout=KV_SCRAPE_TIMEOUT_S)
            except Exception as error:  # noqa: BLE001 - a busy or dying engine is left out of this scrape
                logger.warning("metrics: engine %s did not give its KV store figures: %s", hosted.name, error)
                continue
            if stats is None:
                continue
            for name, _, key in KV_COUNTERS:
                counters[name].add_metric([hosted.name], float(stats[key]))
            stored.add_metric([hosted.name], float(stats[STORED_BYTES[2]]))
        yield from (*counters.values(), stored)
