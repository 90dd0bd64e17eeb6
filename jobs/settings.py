"""Deployment settings shared by the API and the workers, read from `BULKINFER_*` variables.

See docs/pipeline.md ("Configuration"). Plain pydantic: one small class, no extra dependency.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, field_validator

from jobs.object_store.base import ObjectStore

if TYPE_CHECKING:
    import redis

    from jobs.models import ModelRegistry
    from jobs.repository import JobRepository

DEFAULT_BROKER_URL = "redis://127.0.0.1:6379/0"
DEFAULT_STORE_URI = "./.bulkinfer/store"
# field name → environment variable
ENVIRONMENT_NAMES = {
    "broker_url": "BULKINFER_BROKER_URL",
    "store_uri": "BULKINFER_STORE_URI",
    "s3_endpoint_url": "BULKINFER_S3_ENDPOINT_URL",
    "models": "BULKINFER_MODELS",
}


class Settings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    broker_url: str = DEFAULT_BROKER_URL
    store_uri: str = DEFAULT_STORE_URI
    s3_endpoint_url: str | None = None
    models: str | None = None  # JSON {"name": "dir or s3://…"}, or a path to such a file

    @field_validator("store_uri")
    @classmethod
    def _store_uri_is_usable(cls, value: str) -> str:
        if value.startswith("s3://"):
            if not value[len("s3://"):].split("/", 1)[0]:
                raise ValueError(f"s3 store URI has no bucket: {value!r} (expected s3://bucket/prefix)")
        elif "://" in value and not value.startswith("file://"):
            raise ValueError(f"store URI must be s3://bucket/prefix or a local directory, got {value!r}")
        return value

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: str | None) -> Settings:
        """Settings from the environment (empty variables count as unset); `overrides` win."""
        environ = os.environ if environ is None else environ
        values: dict[str, str | None] = {
            field: environ[name] for field, name in ENVIRONMENT_NAMES.items() if environ.get(name)}
        values.update({key: value for key, value in overrides.items() if value is not None})
        return cls.model_validate(values)

    def to_env(self) -> dict[str, str]:
        """The variables that give a child process (a worker) these same settings."""
        return {name: str(getattr(self, field)) for field, name in ENVIRONMENT_NAMES.items()
                if getattr(self, field) is not None}

    @property
    def is_local_store(self) -> bool:
        return not self.store_uri.startswith("s3://")

    def local_store_root(self) -> Path:
        """The directory of a local store, absolute (relative paths are taken from the cwd)."""
        if not self.is_local_store:
            raise ValueError(f"the store is not local: {self.store_uri}")
        return Path(self.store_uri.removeprefix("file://")).expanduser().resolve()

    def open_store(self) -> tuple[ObjectStore, str]:
        """The job store and the key prefix jobs live under in it."""
        if self.is_local_store:
            from jobs.object_store.local import LocalObjectStore

            return LocalObjectStore(self.local_store_root()), ""
        from jobs.object_store.s3 import S3ObjectStore

        bucket, _, prefix = self.store_uri[len("s3://"):].partition("/")
        return S3ObjectStore(bucket, endpoint_url=self.s3_endpoint_url), prefix.strip("/")

    def redis_client(self) -> redis.Redis:
        import redis

        # A Redis that is unreachable (not refusing) must fail a request, not hang it.
        return redis.Redis.from_url(self.broker_url, socket_connect_timeout=5)

    def model_registry(self) -> ModelRegistry:
        from jobs.models import ModelRegistry

        return ModelRegistry.parse(self.models)

    def repository(self) -> JobRepository:
        from jobs.repository import JobRepository

        store, prefix = self.open_store()
        return JobRepository(store, self.redis_client(), prefix=prefix)
