"""A real pipeline for worker tests: Redis, moto S3 and one Celery worker process per module,
running `bulkinfer.worker.process.celery_app` with two task threads and the tiny model.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from celery import Celery

from bulkinfer.api.cli.stack import free_port, redis_server_binary
from bulkinfer.jobs.settings import Settings
from bulkinfer.jobs.spec import JobSpec
from bulkinfer.jobs.state.manifest import Manifest, read_manifest
from bulkinfer.jobs.state.repository import JobRepository
from bulkinfer.jobs.state.status import JobStatus
from bulkinfer.worker.process.celery_app import create_app
from tests.fixtures.services import RedisServer, S3Server, celery_worker, wait_until

JOBS_BUCKET = "jobs"
INPUTS_BUCKET = "inputs"
MODELS_BUCKET = "models"
STORE_PREFIX = "bulkinfer"
# Small enough to be quick, and to make a prompt of a few hundred tokens "too long".
# dtype pinned: outputs are compared with an fp32 offline engine.
ENGINE_OPTIONS = {"max_model_len": 256, "num_kv_blocks": 256, "max_num_seqs": 16,
                  "dtype": "float32"}
JOB_TIMEOUT_S = 90


@dataclass
class Pipeline:
    """The test's side of a running pipeline: the same settings the worker process has."""

    settings: Settings
    repository: JobRepository
    client: Celery
    s3: S3Server

    def put_input(self, name: str, lines: list[str]) -> str:
        body = "".join(line + "\n" for line in lines).encode()
        self.s3.client().put_object(Bucket=INPUTS_BUCKET, Key=name, Body=body)
        return f"s3://{INPUTS_BUCKET}/{name}"

    def submit(self, spec: JobSpec) -> str:
        """Create the job and send `plan_job` by name, as the API does."""
        job_id = self.repository.create(spec).job_id
        self.client.send_task("bulkinfer.plan_job", args=[job_id], queue="bulkinfer.control")
        return job_id

    def wait_for_end(self, job_id: str, timeout: float = JOB_TIMEOUT_S) -> JobStatus:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = self.repository.get(job_id)
            if status.state.is_terminal:
                return status
            time.sleep(0.1)
        raise TimeoutError(f"job {job_id} still {self.repository.get(job_id).state} after {timeout}s")

    def manifest(self, job_id: str) -> Manifest:
        return read_manifest(self.repository.store, self.repository.layout(job_id))

    def jsonl(self, key: str) -> list[dict]:
        return [json.loads(line) for line in self.repository.store.get_bytes(key).splitlines()]

    def output_records(self, job_id: str) -> list[dict]:
        """Every output line of the job, part by part, as the manifest lists them."""
        return [record for part in self.manifest(job_id).parts for record in self.jsonl(part.output.key)]

    def error_records(self, job_id: str) -> list[dict]:
        return [record for part in self.manifest(job_id).parts for record in self.jsonl(part.errors.key)]


@pytest.fixture(scope="module")
def worker_process(redis_server: RedisServer, s3_server: S3Server, tiny_checkpoint: Path,
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Yields the worker's model registry (BULKINFER_MODELS)."""
    models = {"tiny": str(tiny_checkpoint), "tiny-s3": f"s3://{MODELS_BUCKET}/tiny",
              "missing": str(tmp_path_factory.mktemp("models") / "no-such-model")}
    env = {**s3_server.env(), "BULKINFER_STORE_URI": f"s3://{JOBS_BUCKET}/{STORE_PREFIX}",
           "BULKINFER_MODELS": json.dumps(models), "BULKINFER_ENGINE_OPTIONS": json.dumps(ENGINE_OPTIONS),
           "BULKINFER_MODEL_CACHE": str(tmp_path_factory.mktemp("model-cache")),
           "BULKINFER_WORKER_MODELS": "tiny", "HF_HUB_OFFLINE": "1"}
    queues = ",".join(["bulkinfer.control", *(f"bulkinfer.model.{name}" for name in models)])
    # Redis is not flushed between this module's tests: a flush would delete the worker's queue bindings.
    redis_server.client().flushall()
    with celery_worker("bulkinfer.worker.process.celery_app", redis_server.url, env=env, queues=queues,
                       pool="threads",
                       concurrency=2):
        yield env["BULKINFER_MODELS"]


@contextmanager
def bare_pipeline(redis_url: str, s3: S3Server, tiny_checkpoint: Path, model_cache: Path,
                  lease_ttl_s: float = 4) -> Iterator[tuple[Pipeline, dict[str, str]]]:
    """A pipeline with no worker yet (buckets made, a client to send tasks), and the environment a
    worker process needs: the tiny model, short leases and a reaper ticking every second."""
    client = s3.client()
    for bucket in (JOBS_BUCKET, INPUTS_BUCKET, MODELS_BUCKET):
        client.create_bucket(Bucket=bucket)
    models = json.dumps({"tiny": str(tiny_checkpoint)})
    store_uri = f"s3://{JOBS_BUCKET}/{STORE_PREFIX}"
    env = {**s3.env(), "BULKINFER_STORE_URI": store_uri, "BULKINFER_MODELS": models,
           "BULKINFER_ENGINE_OPTIONS": json.dumps(ENGINE_OPTIONS), "BULKINFER_MODEL_CACHE": str(model_cache),
           "BULKINFER_WORKER_MODELS": "tiny", "HF_HUB_OFFLINE": "1",
           "BULKINFER_SHARD_LEASE_TTL_S": str(lease_ttl_s), "BULKINFER_REAPER_INTERVAL_S": "1"}
    settings = Settings(broker_url=redis_url, store_uri=store_uri, s3_endpoint_url=s3.endpoint_url,
                        models=models)
    app = create_app(redis_url, name="bulkinfer-test-client")
    try:
        yield Pipeline(settings, settings.repository(), app, s3), env
    finally:
        app.close()


@pytest.fixture
def pipeline(worker_process: str, redis_server: RedisServer, s3: S3Server) -> Iterator[Pipeline]:
    client = s3.client()
    for bucket in (JOBS_BUCKET, INPUTS_BUCKET, MODELS_BUCKET):
        client.create_bucket(Bucket=bucket)
    settings = Settings(broker_url=redis_server.url, store_uri=f"s3://{JOBS_BUCKET}/{STORE_PREFIX}",
                        s3_endpoint_url=s3.endpoint_url, models=worker_process)
    app = create_app(redis_server.url, name="bulkinfer-test-client")
    try:
        yield Pipeline(settings, settings.repository(), app, s3)
    finally:
        app.close()


@pytest.fixture
def parts(redis_url: str, s3: S3Server, tiny_checkpoint: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Pipeline, dict[str, str]]]:
    """A pipeline with no worker yet, and the environment a worker process needs (4 s leases)."""
    with bare_pipeline(redis_url, s3, tiny_checkpoint, tmp_path_factory.mktemp("model-cache")) as made:
        yield made


class RestartableRedis:
    """A redis-server of this test's own (the session's is shared), restarted with nothing kept."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process = self._start()

    def _start(self) -> subprocess.Popen:
        process = subprocess.Popen(
            [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        wait_until(lambda: redis.Redis.from_url(self.url).ping(), timeout=15, what="redis-server")
        return process

    def restart_empty(self) -> None:
        self.process.kill()
        self.process.wait(timeout=10)
        self.process = self._start()

    def stop(self) -> None:
        self.process.kill()  # also ends one a test left stopped (SIGSTOP)
        self.process.wait(timeout=10)


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[RestartableRedis]:
    server = RestartableRedis(tmp_path)
    try:
        yield server
    finally:
        server.stop()
