"""`ObjectStoreBlobStore`: the engine's `KVBlobStore` (engine/kv_connector/blob_store.py) over the
job domain's object store, so prefix KV blocks live in the same S3 bucket (or local folder) as jobs.

A block is written once, as output parts are: `put_if_absent` is a conditional put (S3's
`IfNoneMatch='*'`, a hard link locally), so two workers saving the same block never overwrite each
other. Outages raise: the engine counts a failed load and computes the block instead.
"""

from __future__ import annotations

from collections.abc import Iterator

from bulkinfer.engine.kv_connector.blob_store import KVBlobInfo
from bulkinfer.jobs.object_store.base import AlreadyExists, ObjectNotFound, ObjectStore


class ObjectStoreBlobStore:
    """Blocks at `<prefix>/<engine key>` in `store` (the engine's keys start with `kv/`)."""

    def __init__(self, store: ObjectStore, prefix: str = "") -> None:
        self.store = store
        self.prefix = f"{prefix.strip('/')}/" if prefix.strip("/") else ""

    def _key(self, key: str) -> str:
        return self.prefix + key

    def get(self, key: str) -> bytes | None:
        try:
            return self.store.get_bytes(self._key(key))
        except ObjectNotFound:
            return None

    def put_if_absent(self, key: str, data: bytes) -> bool:
        try:
            self.store.put_bytes(self._key(key), data, if_none_match=True)
        except AlreadyExists:
            return False
        return True

    def delete(self, key: str) -> None:
        self.store.delete(self._key(key))

    def list(self, prefix: str) -> Iterator[KVBlobInfo]:
        # An object store keeps no read time: a block's last use is its write (S3's LastModified).
        for info in self.store.list(self._key(prefix)):
            yield KVBlobInfo(info.key[len(self.prefix):], info.size, info.modified or 0.0)

    def __repr__(self) -> str:
        return f"ObjectStoreBlobStore({self.store.uri(self.prefix)!r})"
