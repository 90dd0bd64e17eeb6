"""The API served over real HTTP (uvicorn on a free port) with real Redis and moto S3 or a local store."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from bulkinfer.api.app import create_app
from bulkinfer.api.cli.server import ServerThread
from bulkinfer.api.client import ApiError, Client
from bulkinfer.jobs.object_store.base import ObjectStore
from bulkinfer.jobs.settings import Settings
from bulkinfer.jobs.state.repository import JobRepository
from tests.fixtures.services import free_port

BUCKET = "bulkinfer-api"
MODELS = {"tiny": "/models/tiny", "small": "/models/small"}


@dataclass
class RunningApi:
    url: str
    client: Client
    settings: Settings
    repository: JobRepository
    redis: redis.Redis

    @property
    def store(self) -> ObjectStore:
        return self.repository.store

    def input_uri(self, name: str) -> str:
        """Where a test puts an input the API may read: S3, or inside the local store."""
        if self.settings.is_local_store:
            return str(self.settings.local_store_root() / "inputs" / name)
        return f"s3://{BUCKET}/inputs/{name}"

    def put_input(self, name: str, data: bytes) -> str:
        uri = self.input_uri(name)
        if self.settings.is_local_store:
            path = Path(uri)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        else:
            self.store.put_bytes(f"inputs/{name}", data)
        return uri

    def tenant_uri(self, tenant: str, name: str) -> str:
        """Where a tenant's key may read by default: its folder in the job store."""
        if self.settings.is_local_store:
            return str(self.settings.local_store_root() / "tenants" / tenant / name)
        return f"{self.settings.store_uri.rstrip('/')}/tenants/{tenant}/{name}"

    def put_tenant_input(self, tenant: str, name: str, data: bytes) -> str:
        return self.put_uri(self.tenant_uri(tenant, name), data)

    def put_uri(self, uri: str, data: bytes) -> str:
        """Write `data` at `uri` inside the job store (a local path, or a key of its bucket)."""
        if self.settings.is_local_store:
            Path(uri).parent.mkdir(parents=True, exist_ok=True)
            Path(uri).write_bytes(data)
        else:
            self.s3_put(uri, data)
        return uri

    def s3_put(self, uri: str, data: bytes) -> None:
        bucket, _, key = uri.removeprefix("s3://").partition("/")
        assert bucket == BUCKET, uri
        self.store.put_bytes(key, data)  # the job store's bucket: keys are whole keys

    def control_queue_messages(self) -> list[dict]:
        """The task messages waiting on the control queue (kombu's JSON envelope in a Redis list)."""
        return [json.loads(raw) for raw in self.redis.lrange("bulkinfer.control", 0, -1)]


@contextmanager
def serve(settings: Settings) -> Iterator[RunningApi]:
    app = create_app(settings)
    with ServerThread(app, port=free_port()) as server, Client(server.url, timeout=30) as client:
        yield RunningApi(server.url, client, settings, settings.repository(), settings.redis_client())


@pytest.fixture
def s3_api(s3, redis_url) -> Iterator[RunningApi]:
    """The API with its jobs in moto S3 under a prefix."""
    s3.client().create_bucket(Bucket=BUCKET)
    settings = Settings(broker_url=redis_url, store_uri=f"s3://{BUCKET}/deploy",
                        s3_endpoint_url=s3.endpoint_url, models=json.dumps(MODELS))
    with serve(settings) as api:
        yield api


@pytest.fixture
def local_api(redis_url, tmp_path) -> Iterator[RunningApi]:
    """The API with its jobs in a local directory, as `bulkinfer up` runs it."""
    settings = Settings(broker_url=redis_url, store_uri=str(tmp_path / "store"), models=json.dumps(MODELS))
    with serve(settings) as api:
        yield api


@pytest.fixture(params=["s3", "local"])
def api(request) -> RunningApi:
    return request.getfixturevalue(f"{request.param}_api")


def refused(call) -> ApiError:  # noqa: ANN001
    """The ApiError a client call raises (the test fails if it does not)."""
    with pytest.raises(ApiError) as error:
        call()
    return error.value
