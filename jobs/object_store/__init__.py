"""Object stores: `S3ObjectStore` (boto3, any endpoint) and `LocalObjectStore` (a directory)."""

from bulkinfer.jobs.object_store.base import (
    AlreadyExists,
    ObjectInfo,
    ObjectNotFound,
    ObjectStore,
    ObjectStoreError,
    ObjectWriter,
)
from bulkinfer.jobs.object_store.factory import split_uri, store_for_uri
from bulkinfer.jobs.object_store.local import LocalObjectStore
from bulkinfer.jobs.object_store.s3 import S3ObjectStore

__all__ = [
    "AlreadyExists", "LocalObjectStore", "ObjectInfo", "ObjectNotFound", "ObjectStore", "ObjectStoreError",
    "ObjectWriter", "S3ObjectStore", "split_uri", "store_for_uri",
]
