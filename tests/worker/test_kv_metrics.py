"""A worker's /metrics carries each engine's prefix KV tier counters (worker/kv/metrics.py): the
engines that have the tier (ModelHosts given kv_store_options) report them, the others do not."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from bulkinfer.jobs.model_registry import ModelRegistry
from bulkinfer.jobs.object_store import LocalObjectStore
from bulkinfer.worker.hosts.model_hosts import ModelHosts
from bulkinfer.worker.kv.blob_store import ObjectStoreBlobStore
from bulkinfer.worker.kv.metrics import KV_COUNTERS, KVStoreCollector
from tests.worker.conftest import ENGINE_OPTIONS


def test_each_engine_with_the_kv_tier_reports_its_counters_and_the_others_none(tiny_checkpoint: Path,
                                                                             tmp_path: Path) -> None:
    blobs = ObjectStoreBlobStore(LocalObjectStore(tmp_path / "store"))
    with_tier = ModelHosts(ModelRegistry({"tiny": str(tiny_checkpoint)}), ENGINE_OPTIONS, cache_dir=tmp_path,
                           kv_store_options={"kv_store": blobs, "kv_store_min_hits": 3})
    without = ModelHosts(ModelRegistry({"plain": str(tiny_checkpoint)}), ENGINE_OPTIONS, cache_dir=tmp_path)
    try:
        tiny, plain = with_tier.get("tiny"), without.get("plain")
        for hosted in (tiny, plain):
            hosted.host.wait_ready(120)
        config = tiny.host.call(lambda engine: engine.config)
        assert config.kv_store is blobs and config.kv_store_min_hits == 3
        assert plain.host.call(lambda engine: engine.config.kv_store) is None
        registry = CollectorRegistry()
        registry.register(KVStoreCollector(lambda: [tiny, plain]))
        text = generate_latest(registry).decode()
        stats = tiny.host.call(lambda engine: engine.kv_store_stats())
        for name, _, key in KV_COUNTERS:
            assert f'{name}_total{{model="tiny"}} {float(stats[key])}' in text
        assert f'bulkinfer_kv_store_stored_bytes{{model="tiny"}} {float(stats["stored_bytes"])}' in text
        assert 'model="plain"' not in text
    finally:
        with_tier.stop()
        without.stop()
