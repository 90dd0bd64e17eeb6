"""One live deployment per test module, for the SDK and CLI tests: Redis, moto S3, the API over real
HTTP (uvicorn) and a real Celery worker process serving the tiny model. test_end_to_end.py and
test_schedules_live.py build theirs with the same `live_stack`, with their own models, buckets and settings.

Three models, so every job outcome is real and cheap:
- `tiny`: served by the worker; jobs run through the engine and succeed.
- `small`: known to the API and the worker, but no worker consumes its queue: a job is planned and
  then stays `running` (for cancel, timeouts and listing, at no engine cost).
- `retired`: known to the API only; the worker's planner does not know it and fails the job.

Redis is flushed once, when the module starts (a flush between tests would delete the worker's
queue bindings), so tests in these modules never use `redis_url` or `s3`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bulkinfer.api.app import create_app
from bulkinfer.api.cli.server import ServerThread
from bulkinfer.api.client import Client
from bulkinfer.jobs.names import QUEUE_PREFIX
from bulkinfer.jobs.settings import Settings
from bulkinfer.jobs.state.repository import JobRepository
from tests.fixtures.services import REPO_ROOT, RedisServer, S3Server, celery_worker, free_port

JOBS_BUCKET = "sdk-jobs"
INPUTS_BUCKET = "sdk-inputs"
ENGINE_OPTIONS = {"max_model_len": 256, "num_kv_blocks": 128, "max_num_seqs": 16}


@dataclass
class LiveStack:
    url: str
    client: Client
    repository: JobRepository
    s3: S3Server
    env: dict[str, str]  # what a child process (the CLI) needs to reach this S3
    inputs_bucket: str = INPUTS_BUCKET
    settings: Settings | None = None  # the API's (another API over the same deployment: create_app(settings))

    def put_input(self, name: str, body: bytes) -> str:
        self.s3.client().put_object(Bucket=self.inputs_bucket, Key=name, Body=body)
        return f"s3://{self.inputs_bucket}/{name}"

    def cli_env(self, **extra: str) -> dict[str, str]:
        return {**os.environ, **self.env, "PYTHONPATH": str(REPO_ROOT), **extra}


@contextmanager
def live_stack(redis_server: RedisServer, s3_server: S3Server, tiny_checkpoint: Path, model_cache: Path, *,
               models: dict[str, str] | None = None, worker_models: dict[str, str] | None = None,
               jobs_bucket: str = JOBS_BUCKET, inputs_bucket: str = INPUTS_BUCKET,
               engine_options: dict[str, Any] | None = None, client_options: dict[str, Any] | None = None,
               settings_fields: dict[str, Any] | None = None,
               worker_served: tuple[str, ...] = ("tiny",),
               worker_s3_endpoint: str | None = None) -> Iterator[LiveStack]:
    """Flush Redis, reset S3 and make the buckets, then run a worker serving `tiny`, the API and a client.

    `models=None` is the SDK tests' deployment (the three models of the module docstring);
    otherwise `models` are the API's and `worker_models` the worker's (None: the same as the API's).
    `settings_fields` are extra `Settings` fields (the worker gets them too, through its environment).
    `worker_served`: the models whose queues the worker consumes (and preloads).
    `worker_s3_endpoint`: where the worker reaches S3, when not straight at moto (a fault proxy).
    """
    if models is None:
        worker_models = {"tiny": str(tiny_checkpoint), "small": "/nonexistent/small"}
        models = {**worker_models, "retired": "/nonexistent/retired"}
    engine_options = ENGINE_OPTIONS if engine_options is None else engine_options
    client_options = {"timeout": 30, "backoff": 0.05} if client_options is None else client_options
    redis_server.client().flushall()
    s3_server.reset()
    for bucket in (jobs_bucket, inputs_bucket):
        s3_server.client().create_bucket(Bucket=bucket)
    settings = Settings(broker_url=redis_server.url, store_uri=f"s3://{jobs_bucket}/bulkinfer",
                        s3_endpoint_url=s3_server.endpoint_url, models=json.dumps(models),
                        **(settings_fields or {}))
    worker_env = {**s3_server.env(), **settings.to_env(), "BULKINFER_WORKER_MODELS": ",".join(worker_served),
                  "BULKINFER_ENGINE_OPTIONS": json.dumps(engine_options), "HF_HUB_OFFLINE": "1",
                  "BULKINFER_MODEL_CACHE": str(model_cache)}
    if worker_models is not None:
        worker_env["BULKINFER_MODELS"] = json.dumps(worker_models)
    if worker_s3_endpoint is not None:
        worker_env["BULKINFER_S3_ENDPOINT_URL"] = worker_s3_endpoint
    queues = ",".join(["bulkinfer.control", *(QUEUE_PREFIX + name for name in worker_served)])
    with pytest.MonkeyPatch.context() as patch:
        for name, value in s3_server.env().items():  # S3 credentials for the API in this process
            patch.setenv(name, value)
        with celery_worker("bulkinfer.worker.process.celery_app", redis_server.url, env=worker_env,
                           queues=queues,
                           pool="threads", concurrency=2), \
                ServerThread(create_app(settings), port=free_port()) as server, \
                Client(server.url, **client_options) as client:
            yield LiveStack(server.url, client, settings.repository(), s3_server, s3_server.env(),
                            inputs_bucket, settings)
