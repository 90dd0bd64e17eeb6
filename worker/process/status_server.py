"""A worker's own HTTP endpoint and heartbeat: what Prometheus, Kubernetes and the API's /ui read.

- `/metrics`: the worker's Prometheus metrics (worker/process/metrics.py).
- `/healthz`: 200 while the process answers (a liveness probe).
- `/readyz`: 200 only once every model the worker preloads is loaded and healthy, else 503 with
  each model's state (a readiness probe: a pod takes no traffic, and an autoscaler counts it as
  starting, until its engines are up).

The heartbeat (jobs/workers.py) puts the worker's models, dtype, device and recent throughput into
Redis every few seconds, where the API finds the live workers.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import redis
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from bulkinfer.jobs.workers import (
    BEAT_INTERVAL_S,
    WorkerBeat,
    WorkerModel,
    clear_beat,
    record_throughput,
    write_beat,
)
from bulkinfer.worker.process import engine_metrics, metrics
from bulkinfer.worker.process.context import WorkerContext

logger = logging.getLogger(__name__)

METRICS_PATH = "/metrics"
HEALTH_PATH = "/healthz"
READY_PATH = "/readyz"
LOADING_BEAT_INTERVAL_S = 0.5


def readiness(context: WorkerContext, models: list[str]) -> tuple[bool, dict[str, str]]:
    """(ready, each preloaded model's state): ready once all of them are loaded."""
    states = {name: context.hosts.state(name) for name in models}
    return all(state == "loaded" for state in states.values()), states


class _Handler(BaseHTTPRequestHandler):
    context: WorkerContext
    models: list[str]

    def do_GET(self) -> None:  # noqa: N802 - the http.server name
        path = self.path.split("?", 1)[0]
        if path == METRICS_PATH:
            self._send(200, generate_latest(metrics.REGISTRY), CONTENT_TYPE_LATEST)
        elif path == HEALTH_PATH:
            self._send_json(200, {"status": "ok"})
        elif path == READY_PATH:
            ready, states = readiness(self.context, self.models)
            self._send_json(200 if ready else 503, {"ready": ready, "models": states})
        else:
            self._send_json(404, {"detail": f"no such path {path!r}: try {METRICS_PATH}, {HEALTH_PATH}, "
                                            f"{READY_PATH}"})

    def _send_json(self, status: int, body: dict[str, Any]) -> None:
        self._send(status, json.dumps(body).encode(), "application/json")

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - probes every few seconds: not logged
        pass


class StatusServer:
    """The endpoint (a daemon thread) and the heartbeat (another), for one worker process."""

    def __init__(self, context: WorkerContext, hostname: str, models: list[str], port: int,
                 host: str = "0.0.0.0") -> None:
        self.context = context
        self.hostname = hostname
        self.models = models
        handler = type("Handler", (_Handler,), {"context": context, "models": models})
        self.server = ThreadingHTTPServer((host, port), handler) if port else None
        self.started_at = datetime.now(UTC)
        self._stop = threading.Event()
        self._last_tokens: dict[str, tuple[float, float]] = {}  # model -> (tokens generated, when)

    @property
    def port(self) -> int | None:
        return self.server.server_address[1] if self.server else None

    def start(self) -> StatusServer:
        if self.server is not None:
            threading.Thread(target=self.server.serve_forever, name="status-server", daemon=True).start()
            logger.info("worker %s: metrics and probes on port %d", self.hostname, self.port)
        threading.Thread(target=self._beat_forever, name="worker-heartbeat", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self.server is not None:
            self.server.shutdown()
        repository = self.context.repository
        try:
            clear_beat(repository.redis, repository.namespace, self.hostname)
        except redis.RedisError:  # it expires by itself
            pass

    def _beat_forever(self) -> None:
        while not self._stop.is_set():
            try:
                repository = self.context.repository
                beat = self.beat()
                write_beat(repository.redis, repository.namespace, beat)
                record_throughput(repository.redis, repository.namespace, beat)
            except Exception as error:  # noqa: BLE001 - Redis down for a moment: the next beat tries again
                logger.warning("worker heartbeat failed: %s", error)
            # While a model loads, beat often, so the API sees it loaded within a moment.
            loading = any(self.context.hosts.state(name) == "loading" for name in self.models)
            self._stop.wait(LOADING_BEAT_INTERVAL_S if loading else BEAT_INTERVAL_S)

    def beat(self) -> WorkerBeat:
        models = []
        hosted = {entry.name: entry for entry in self.context.hosts.hosted()}
        for name in dict.fromkeys([*self.models, *hosted]):
            entry = hosted.get(name)
            model = WorkerModel(name=name, state=self.context.hosts.state(name))
            if entry is not None and model.state == "loaded":
                choice = entry.host.dtype_choice
                model.dtype, model.device = (choice.dtype if choice else None), entry.host.device
                figures = engine_metrics.engine_figures(entry)
                if figures is not None:
                    model.running, model.waiting = int(figures["num_running"]), int(figures["num_waiting"])
                    model.tokens_per_s = self._recent_rate(name, figures)
                    model.busy_s = float(figures.get("busy_time_s", 0.0))
                    model.tokens_computed = int(figures.get("prefill_tokens_computed", 0)) + int(
                        figures.get("generation_tokens", 0))
            models.append(model)
        return WorkerBeat(hostname=self.hostname, pid=os.getpid(), started_at=self.started_at,
                          updated_at=datetime.now(UTC), models=models)

    def _recent_rate(self, name: str, figures: dict[str, Any]) -> float:
        """Generated tokens per wall second since the last beat."""
        now, tokens = time.monotonic(), float(figures["generation_tokens"])
        previous = self._last_tokens.get(name)
        self._last_tokens[name] = (tokens, now)
        if previous is None or now <= previous[1]:
            return 0.0
        return max(0.0, (tokens - previous[0]) / (now - previous[1]))
