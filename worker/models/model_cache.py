"""The machine's model cache: downloaded, fetched and imported model folders, shared by every
worker and command on the machine (the `model_cache` setting, default ~/.cache/bulkinfer/models)."""

from __future__ import annotations

import fcntl
import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bulkinfer.jobs.settings import process_settings


def model_cache_dir() -> Path:
    """The process's `model_cache` setting: where callers that are handed no folder look."""
    return process_settings().model_cache_dir


@contextmanager
def cache_lock(cache_dir: Path, key: str) -> Iterator[None]:
    """Held while one process makes the cache entry `key`: another one waits, then finds it made."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / f".{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()
