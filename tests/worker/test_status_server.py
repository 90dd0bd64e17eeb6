"""A worker's own endpoint: /readyz says 503 until its engines are loaded, /metrics carries the
engines' figures read when scraped, the heartbeat reaches Redis and leaves it on stop. One
component: the engine hosts are stand-ins; Redis is real."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import httpx
import redis

from bulkinfer.jobs.workers import live_workers
from bulkinfer.worker.process import engine_metrics, metrics
from bulkinfer.worker.process.status_server import StatusServer
from tests.fixtures.services import free_port

FIGURES = {"num_running": 5, "num_waiting": 2, "kv_blocks_used": 40, "kv_blocks_total": 100,
           "prefix_cache_hit_rate": 0.75, "num_preemptions": 1, "num_steps": 9, "busy_time_s": 1.5,
           "generation_tokens": 300,
           "speculative_decoding": {"num_draft_tokens": 120, "num_accepted_tokens": 90,
                                    "num_verifications": 40}}


class StandInHost:
    def __init__(self) -> None:
        self.loaded = False
        self.failure = None
        self.load_seconds = None
        self.device = "cpu"
        self.dtype_choice = SimpleNamespace(dtype="bfloat16")

    def call(self, function, timeout=None):  # noqa: ANN001, ANN201 - LLMEngine.get_metrics, between steps
        return function(SimpleNamespace(get_metrics=lambda: FIGURES))


@dataclass
class StandInHosts:
    host: StandInHost = field(default_factory=StandInHost)

    def hosted(self) -> list:
        return [SimpleNamespace(name="tiny", host=self.host)]

    def state(self, name: str) -> str:
        return "loaded" if self.host.loaded else "loading"


def test_ready_only_once_loaded_with_engine_figures_and_a_heartbeat(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    hosts = StandInHosts()
    repository = SimpleNamespace(redis=client, namespace="bulkinfer")
    context = SimpleNamespace(hosts=hosts, repository=repository)
    collector = engine_metrics.EngineCollector(hosts.hosted)
    metrics.REGISTRY.register(collector)
    server = StatusServer(context, "w1@host", ["tiny"], free_port(), host="127.0.0.1").start()
    base = f"http://127.0.0.1:{server.port}"
    try:
        assert httpx.get(f"{base}/healthz").status_code == 200
        waiting = httpx.get(f"{base}/readyz")
        assert waiting.status_code == 503
        assert waiting.json() == {"ready": False, "models": {"tiny": "loading"}}
        hosts.host.loaded, hosts.host.load_seconds = True, 3.25
        assert httpx.get(f"{base}/readyz").json() == {"ready": True, "models": {"tiny": "loaded"}}
        text = httpx.get(f"{base}/metrics").text
        for line in ('bulkinfer_engine_running_requests{model="tiny"} 5.0',
                     'bulkinfer_engine_kv_blocks_used{model="tiny"} 40.0',
                     'bulkinfer_engine_prefix_cache_hit_ratio{model="tiny"} 0.75',
                     'bulkinfer_engine_preemptions_total{model="tiny"} 1.0',
                     'bulkinfer_engine_load_seconds{model="tiny"} 3.25',
                     'bulkinfer_engine_info{device="cpu",dtype="bfloat16",model="tiny"} 1.0',
                     'bulkinfer_engine_spec_accepted_tokens_total{model="tiny"} 90.0',
                     'bulkinfer_engine_spec_draft_tokens_total{model="tiny"} 120.0'):
            assert line in text, line
        assert httpx.get(f"{base}/nope").status_code == 404
        beat = server.beat()
        assert [(m.name, m.state, m.dtype, m.running) for m in beat.models] == [
            ("tiny", "loaded", "bfloat16", 5)]
        # The heartbeat thread beats every half second while a model loads, then every few seconds.
        deadline = time.monotonic() + 10
        while not [w for w in live_workers(client, "bulkinfer") if w.models[0].state == "loaded"]:
            assert time.monotonic() < deadline, "no loaded heartbeat in Redis"
            time.sleep(0.1)
    finally:
        server.stop()
        metrics.REGISTRY.unregister(collector)
    assert live_workers(client, "bulkinfer") == []  # a stopped worker leaves the list at once
