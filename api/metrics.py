"""The API's Prometheus metrics (`GET /metrics`), read from Redis when scraped.

Jobs by status (every tenant's), the Celery queue length of the control queue and of each served
model's queue (what an autoscaler scales workers on), and the live workers per model from their
heartbeats (jobs/workers.py). One registry per app, so a test that builds many apps, or `serve all`
beside a worker, never registers a name twice.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric

from bulkinfer.jobs.model_registry import ModelRegistry
from bulkinfer.jobs.names import CONTROL_QUEUE
from bulkinfer.jobs.state.repository import JobRepository
from bulkinfer.jobs.workers import live_workers

# kombu's Redis transport keeps a queue's messages of priority p > 0 in "<queue>\x06\x16<p>".
PRIORITY_SEPARATOR = "\x06\x16"
KOMBU_PRIORITY_STEPS = (0, 3, 6, 9)


def queue_length(repository: JobRepository, queue: str) -> int:
    """Messages waiting in a Celery queue (not the ones a worker is running: those are unacked)."""
    pipe = repository.redis.pipeline(transaction=False)
    for step in KOMBU_PRIORITY_STEPS:
        pipe.llen(queue if step == 0 else f"{queue}{PRIORITY_SEPARATOR}{step}")
    return sum(int(length) for length in pipe.execute())


class ServiceCollector:
    def __init__(self, repository: JobRepository, registry: ModelRegistry) -> None:
        self.repository = repository
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        jobs = GaugeMetricFamily("bulkinfer_jobs", "Jobs by status, every tenant's", labels=["status"])
        for status, count in self.repository.count_by_state().items():
            jobs.add_metric([status], count)
        queues = GaugeMetricFamily("bulkinfer_queue_length", "Tasks waiting in each Celery queue",
                                   labels=["queue"])
        for queue in [CONTROL_QUEUE, *(self.registry.queue_for(name) for name in self.registry.names())]:
            queues.add_metric([queue], queue_length(self.repository, queue))
        workers = GaugeMetricFamily("bulkinfer_workers", "Live workers with the model loaded",
                                    labels=["model"])
        counts = dict.fromkeys(self.registry.names(), 0)
        for beat in live_workers(self.repository.redis, self.repository.namespace):
            for model in beat.models:
                if model.state == "loaded":
                    counts[model.name] = counts.get(model.name, 0) + 1
        for name, count in counts.items():
            workers.add_metric([name], count)
        yield from (jobs, queues, workers)


def service_registry(repository: JobRepository, registry: ModelRegistry) -> CollectorRegistry:
    metrics = CollectorRegistry()
    metrics.register(ServiceCollector(repository, registry))
    return metrics
