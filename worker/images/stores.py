"""`StoreOpener`: the store and key of an `s3://` or local image location, as `input_uri` is opened
(`store_for_uri`), with one S3 client shared by every bucket a job's images name."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from bulkinfer.jobs.object_store.base import ObjectStore
from bulkinfer.jobs.object_store.factory import split_uri

# (store, key) of a location; raises ValueError for one split_uri refuses.
OpenStore = Callable[[str], tuple[ObjectStore, str]]


class StoreOpener:
    def __init__(self, endpoint_url: str | None = None, client: Any = None) -> None:
        self.endpoint_url = endpoint_url
        self._client = client  # a boto3 S3 client; made on the first s3:// image
        self._buckets: dict[str, ObjectStore] = {}
        self._lock = threading.Lock()

    def __call__(self, uri: str) -> tuple[ObjectStore, str]:
        scheme, bucket, key = split_uri(uri)
        if scheme != "s3":
            from bulkinfer.jobs.object_store.local import LocalObjectStore

            return LocalObjectStore("/"), key  # split_uri's key: the absolute path without its '/'
        with self._lock:
            store = self._buckets.get(bucket)
            if store is None:
                from bulkinfer.jobs.object_store.s3 import S3ObjectStore, make_s3_client

                self._client = self._client or make_s3_client(self.endpoint_url)
                store = self._buckets[bucket] = S3ObjectStore(bucket, client=self._client)
        return store, key
