"""What every route needs, built once per app: settings, the repository, models, the task sender."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request

from bulkinfer.api.dispatch import TaskSender
from bulkinfer.jobs.model_registry import ModelRegistry
from bulkinfer.jobs.object_store.base import ObjectStore
from bulkinfer.jobs.settings import Settings
from bulkinfer.jobs.state.repository import JobRepository


@dataclass
class ApiContext:
    settings: Settings
    repository: JobRepository
    registry: ModelRegistry
    tasks: TaskSender
    _s3_stores: dict[str, ObjectStore] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def store(self) -> ObjectStore:
        return self.repository.store

    def s3_store(self, bucket: str) -> ObjectStore:
        """One store (one boto3 client) per bucket, reused across requests."""
        with self._lock:
            if bucket not in self._s3_stores:
                from bulkinfer.jobs.object_store.s3 import S3ObjectStore

                job_store = self.repository.store
                same = isinstance(job_store, S3ObjectStore) and job_store.bucket == bucket
                self._s3_stores[bucket] = job_store if same else S3ObjectStore(
                    bucket, endpoint_url=self.settings.s3_endpoint_url)
            return self._s3_stores[bucket]


def get_context(request: Request) -> ApiContext:
    return request.app.state.context


Context = Annotated[ApiContext, Depends(get_context)]
