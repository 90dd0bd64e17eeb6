"""The object-store interface every job component uses: keys are '/'-separated paths."""

from __future__ import annotations

import builtins
import io
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import BinaryIO

from bulkinfer.jobs.object_store.range_file import RangeReadFile


class ObjectStoreError(Exception):
    """Base class for object-store failures that callers may want to tell apart."""


class AlreadyExists(ObjectStoreError):
    """A write-once put found the key already written."""

    def __init__(self, key: str) -> None:
        super().__init__(f"object already exists: {key}")
        self.key = key


class ObjectNotFound(ObjectStoreError, FileNotFoundError):
    """The key does not exist in the store."""

    def __init__(self, key: str) -> None:
        super().__init__(f"object not found: {key}")
        self.key = key


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    etag: str
    modified: float | None = None  # unix seconds of the last write, where the store says


@dataclass(frozen=True)
class UnfinishedWrite:
    """A write that never completed (an S3 multipart upload, a local temp file)."""

    key: str
    started: float  # unix seconds
    handle: str  # what the store needs to abort it (the upload id, the temp file's key)


class ObjectWriter(io.RawIOBase):
    """A streaming write: bytes become visible under the key only when `close()` succeeds.

    Leaving a `with` block by an exception calls `abort()` instead, so nothing half-written is
    ever visible. After close, `size` is the number of bytes written.
    """

    size: int = 0

    def writable(self) -> bool:
        return True

    @abstractmethod
    def abort(self) -> None:
        """Drop everything written so far; the key is left as it was."""

    def __exit__(self, exc_type: object, exc: object, traceback: object) -> None:
        if exc_type is not None:
            self.abort()
        else:
            self.close()


class ObjectStore(ABC):
    """Where job specs, inputs, output parts and manifests live (S3 or a local directory)."""

    @abstractmethod
    def put_bytes(self, key: str, data: bytes, if_none_match: bool = False) -> ObjectInfo:
        """Write `data` at `key`. With `if_none_match`, raise `AlreadyExists` if the key exists."""

    @abstractmethod
    def get_bytes(self, key: str) -> bytes:
        """The whole object: only for small objects (specs, manifests, results)."""

    @abstractmethod
    def open_read(self, key: str, start: int = 0) -> BinaryIO:
        """A forward-only stream of the object from byte `start`; close it when done."""

    @abstractmethod
    def read_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes `[start, end)`, clipped to the object's size (empty past the end)."""

    @abstractmethod
    def open_write(self, key: str, if_none_match: bool = False) -> ObjectWriter:
        """A streaming writer (S3 multipart for large objects); see `ObjectWriter`."""

    @abstractmethod
    def head(self, key: str) -> ObjectInfo:
        """Size and etag; raises `ObjectNotFound`."""

    @abstractmethod
    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object whose key starts with `prefix`, in key order, fetched page by page."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove the key; deleting a missing key is not an error."""

    @abstractmethod
    def presign_get(self, key: str, expires: int = 3600) -> str:
        """A URI a client can GET without credentials for `expires` seconds."""

    @abstractmethod
    def uri(self, key: str) -> str:
        """The `s3://…` or `file://…` URI of `key`, accepted back by `store_for_uri`."""

    def copy(self, source_key: str, key: str) -> None:
        """Write the object at `source_key` to `key` (replacing it); raises `ObjectNotFound` if the
        source is missing. Default: streamed through this process (S3 copies server-side)."""
        with self.open_read(source_key) as source, self.open_write(key) as writer:
            while chunk := source.read(8 << 20):
                writer.write(chunk)

    def exists(self, key: str) -> bool:
        try:
            self.head(key)
        except ObjectNotFound:
            return False
        return True

    def unfinished_writes(self, prefix: str) -> builtins.list[UnfinishedWrite]:
        """Writes under `prefix` that never completed. Default: none (a store without such state)."""
        return []

    def abort_write(self, write: UnfinishedWrite) -> None:
        """Drop one unfinished write (one `unfinished_writes` returned)."""
        raise NotImplementedError(f"{type(self).__name__} has no unfinished writes to abort")

    def abort_unfinished_writes(self, prefix: str, older_than_s: float = 0.0,
                                only: Callable[[str], bool] | None = None) -> int:
        """Remove what writers under `prefix` left when their process died mid-write (S3 multipart
        uploads never completed, local temp files) and started more than `older_than_s` ago (and,
        given `only`, whose key it accepts); returns how many. With no age, call it only where no
        write is running (a job's finalize)."""
        now = time.time()
        aborted = 0
        for write in self.unfinished_writes(prefix):
            if now - write.started >= older_than_s and (only is None or only(write.key)):
                self.abort_write(write)
                aborted += 1
        return aborted

    def open_seekable(self, key: str) -> BinaryIO:
        """A seekable read-only file over range reads (what pyarrow needs for Parquet footers).

        Unbuffered on purpose: each read is one range request of exactly the bytes asked for, so
        pyarrow's column-chunk reads fetch no neighbouring row groups.
        """
        return RangeReadFile(partial(self.read_range, key), self.head(key).size)  # type: ignore[return-value]

    def put_once_or_same(self, key: str, data: bytes) -> bool:
        """Write-once that tolerates an identical earlier write (a finalize that runs twice).

        Returns True if this call wrote the object; raises `AlreadyExists` if different bytes
        are already there.
        """
        try:
            self.put_bytes(key, data, if_none_match=True)
        except AlreadyExists:
            if self.get_bytes(key) != data:
                raise
            return False
        return True
