"""What the engine needs of storage for prefix KV blocks, and two implementations.

``KVBlobStore`` is the whole contract (the service adapts its S3 object store to it):
write-once puts, gets that return None for an absent key and raise on an outage, deletes and
listings with sizes and last-use times (for least-recently-used deletion past a budget).
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class KVBlobInfo:
    key: str
    size: int
    last_used: float  # seconds since the epoch: last read or write, as well as the store knows


@runtime_checkable
class KVBlobStore(Protocol):
    def get(self, key: str) -> bytes | None:
        """The blob, or None when absent; raises (OSError or any Exception) when the store fails."""
        ...

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Write once: False (nothing written) when the key already holds a blob."""
        ...

    def delete(self, key: str) -> None:
        """Remove the key; no error when it is absent."""
        ...

    def list(self, prefix: str) -> Iterator[KVBlobInfo]:
        """Every blob whose key starts with `prefix`."""
        ...


class LocalFolderBlobStore:
    """Blobs as files under a folder (tests, `bulkinfer run`, and the disk cache in front of S3).

    Writes go to a temporary file that is then hard-linked into place, so a reader never sees a
    partial blob and of two concurrent writers exactly one wins. A read touches the file's
    modification time: that is the least-recently-used order a budget deletes by.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        parts = key.split("/")
        if not key or key.startswith("/") or any(part in ("", ".", "..") for part in parts[:-1]) \
                or parts[-1] in (".", ".."):
            raise ValueError(f"invalid blob key {key!r}")
        return self.root.joinpath(*parts)

    def get(self, key: str) -> bytes | None:
        path = self._path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            os.utime(path)
        except FileNotFoundError:  # deleted since: the bytes read are still whole
            pass
        return data

    def put_if_absent(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        if path.exists():
            return False
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temp = tempfile.mkstemp(dir=path.parent, prefix=".partial-")
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
            os.link(temp, path)  # atomic, and fails where another writer got there first
            return True
        except FileExistsError:
            return False
        finally:
            os.unlink(temp)

    def delete(self, key: str) -> None:
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            pass

    def list(self, prefix: str) -> Iterator[KVBlobInfo]:
        for directory, _, files in os.walk(self.root):
            for name in files:
                if name.startswith(".partial-"):
                    continue
                path = Path(directory, name)
                key = path.relative_to(self.root).as_posix()
                if not key.startswith(prefix):
                    continue
                try:
                    stat = path.stat()
                except FileNotFoundError:
                    continue
                yield KVBlobInfo(key, stat.st_size, stat.st_mtime)

    def total_bytes(self) -> int:
        return sum(info.size for info in self.list(""))


class CachedBlobStore:
    """A local folder in front of a slower store (S3): reads try the folder first and fill it from
    the back store; writes go to the back store (the truth) and then the folder. The folder is
    kept under `front_max_bytes`, least recently used files deleted first."""

    def __init__(self, front: LocalFolderBlobStore, back: KVBlobStore, front_max_bytes: int) -> None:
        if front_max_bytes < 0:
            raise ValueError(f"front_max_bytes must be >= 0, got {front_max_bytes}")
        self.front = front
        self.back = back
        self.front_max_bytes = front_max_bytes
        self._front_bytes: int | None = None  # measured on first use, then kept up
        self._lock = threading.Lock()

    def get(self, key: str) -> bytes | None:
        data = self.front.get(key)
        if data is not None:
            return data
        data = self.back.get(key)
        if data is not None:
            self._fill_front(key, data)
        return data

    def put_if_absent(self, key: str, data: bytes) -> bool:
        written = self.back.put_if_absent(key, data)
        if written:  # else the back store's blob is the truth, and the front fills on a read
            self._fill_front(key, data)
        return written

    def delete(self, key: str) -> None:
        self.back.delete(key)
        self.front.delete(key)

    def list(self, prefix: str) -> Iterator[KVBlobInfo]:
        return self.back.list(prefix)

    def _fill_front(self, key: str, data: bytes) -> None:
        if len(data) > self.front_max_bytes:
            return
        if not self.front.put_if_absent(key, data):
            return
        with self._lock:
            if self._front_bytes is None:
                self._front_bytes = self.front.total_bytes()
            else:
                self._front_bytes += len(data)
            if self._front_bytes > self.front_max_bytes:
                self._trim_front()

    def _trim_front(self) -> None:
        """Delete the folder's least recently used files until it holds at most 90% of its cap
        (some room, so the next fills do not each trigger a listing)."""
        entries = sorted(self.front.list(""), key=lambda info: info.last_used)
        total = sum(info.size for info in entries)
        target = int(self.front_max_bytes * 0.9)
        for info in entries:
            if total <= target:
                break
            self.front.delete(info.key)
            total -= info.size
        self._front_bytes = total

