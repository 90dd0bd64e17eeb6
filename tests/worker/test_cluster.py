"""Several workers on one Redis and one S3, as on a cluster: a job's shards spread over them, a
worker told to stop (SIGTERM, as Kubernetes does) hands its running shards back within seconds and
the job completes on the other with nothing lost; each worker's /readyz, /metrics and heartbeat
say what it is doing."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager

import httpx
import pytest

from bulkinfer.api.app import create_app
from bulkinfer.api.cli.server import ServerThread
from bulkinfer.jobs.spec import JobSpec
from bulkinfer.jobs.state.status import JobState
from tests.fixtures.services import RedisServer, celery_worker, free_port, wait_until
from tests.worker.conftest import Pipeline

pytestmark = pytest.mark.timeout(600)

QUEUES = "bulkinfer.control,bulkinfer.model.tiny"
SHARDS, ROWS_PER_SHARD = 6, 16
STOP_WITHIN_S = 20  # a pod's grace period is 60 s; a shard here runs longer than this


@contextmanager
def started_together(redis_url: str, *envs: dict[str, str]) -> Iterator[list[subprocess.Popen]]:
    """One worker process per environment, started side by side (each waits until it answers a
    ping); each is stopped at the end, the last first."""
    managers = [celery_worker("bulkinfer.worker.process.celery_app", redis_url, env=env, queues=QUEUES,
                              pool="threads", concurrency=2, ready_timeout=120) for env in envs]
    with ExitStack() as stack:
        with ThreadPoolExecutor(len(managers)) as pool:
            futures = [pool.submit(manager.__enter__) for manager in managers]
        failures = []
        for manager, future in zip(managers, futures, strict=True):
            if future.exception() is None:  # one that failed to start stopped its process itself
                stack.push(manager.__exit__)
            else:
                failures.append(future.exception())
        if failures:
            raise failures[0]
        yield [future.result() for future in futures]


def metric(port: int, name: str) -> float:
    """The sum of one metric's samples on a worker's /metrics (0 when absent)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and (line[len(name)] in "{ "))


def long_job(pipeline: Pipeline) -> JobSpec:
    rows = SHARDS * ROWS_PER_SHARD
    lines = [json.dumps({"id": f"q{n:03d}", "question": f"def f{n}(x):"}) for n in range(rows)]
    # 200 tokens a row, 16 rows a shard: each shard runs for many seconds on the tiny model.
    return JobSpec(input_uri=pipeline.put_input("cluster.jsonl", lines), model="tiny", id_column="id",
                   prompt_column="question", sampling={"temperature": 0.0, "max_tokens": 200},
                   shard_size=ROWS_PER_SHARD)


def test_a_worker_stopped_mid_job_hands_its_shards_back_and_the_job_completes_on_the_other(
        parts: tuple[Pipeline, dict[str, str]], redis_server: RedisServer) -> None:
    pipeline, env = parts
    ports = free_port(), free_port()
    env_a = {**env, "BULKINFER_WORKER_METRICS_PORT": str(ports[0])}
    env_b = {**env, "BULKINFER_WORKER_METRICS_PORT": str(ports[1]), "BULKINFER_LOG_FORMAT": "json"}
    api = ServerThread(create_app(pipeline.settings), port=free_port())
    with started_together(redis_server.url, env_a, env_b) as (worker_a, worker_b), api:
        for port in ports:  # ready only once the engine is loaded
            ready = f"http://127.0.0.1:{port}/readyz"
            wait_until(lambda ready=ready: httpx.get(ready, timeout=5).status_code == 200, 120,
                     f"worker on {port} to load its model")
            assert httpx.get(ready, timeout=5).json()["models"] == {"tiny": "loaded"}
        spec = json.loads(long_job(pipeline).model_dump_json())
        created = httpx.post(f"{api.url}/jobs", json=spec, timeout=30)
        assert created.status_code == 201, created.text
        job_id = created.json()["job_id"]
        # Both workers run shards of the job.
        wait_until(lambda: all(metric(port, "bulkinfer_engine_running_requests") > 0 for port in ports),
                 180, "both workers to run rows of the job")

        def both_beat_loaded() -> bool:  # heartbeats come every few seconds
            beats = httpx.get(f"{api.url}/workers", timeout=10).json()["workers"]
            return [(w["hostname"], w["models"][0]["state"], w["models"][0]["dtype"]) for w in beats] == [
                (node, "loaded", "float32") for node in sorted([worker_a.node, worker_b.node])]

        wait_until(both_beat_loaded, 30, "both workers' heartbeats to show the loaded model")

        stopped_at = time.monotonic()
        worker_a.send_signal(signal.SIGTERM)
        worker_a.wait(timeout=60)
        stop_seconds = time.monotonic() - stopped_at
        log_a = worker_a.log_path.read_text()
        assert worker_a.returncode == 0, log_a[-3000:]
        assert stop_seconds < STOP_WITHIN_S, f"the worker took {stop_seconds:.1f}s to stop"
        assert "handed back" in log_a, log_a[-3000:]

        status = pipeline.wait_for_end(job_id, timeout=400)
        assert metric(ports[1], "bulkinfer_worker_rows_total") > 0
        metrics_page = httpx.get(f"{api.url}/metrics", timeout=10).text
        assert 'bulkinfer_jobs{status="succeeded"} 1.0' in metrics_page
    assert status.state == JobState.SUCCEEDED, status.error
    # Worker B logs JSON lines, those about a shard carrying the job, the shard and the worker.
    lines = [json.loads(line) for line in worker_b.log_path.read_text().splitlines() if line.startswith("{")]
    about_shards = [line for line in lines if line.get("job_id") == job_id and "shard" in line]
    assert about_shards and all(line["worker"] == worker_b.node for line in about_shards)
    assert {"time", "level", "logger", "message"} <= set(about_shards[0])
    rows = SHARDS * ROWS_PER_SHARD
    assert (status.rows.total, status.rows.succeeded, status.shards.done) == (rows, rows, SHARDS)
    records = pipeline.output_records(job_id)
    # every row once, in input order
    assert [record["id"] for record in records] == [f"q{n:03d}" for n in range(rows)]
