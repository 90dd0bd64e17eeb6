"""A model's files on local disk: a registry location that is a directory is used as it is; an
`s3://bucket/prefix` location is downloaded once into a cache directory and reused after that.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from jobs.object_store.factory import store_for_uri
from worker.transient import is_transient

CACHE_ENV = "BULKINFER_MODEL_CACHE"
# Written last into a downloaded folder: a folder without it is a download that did not finish.
COMPLETE_MARKER = ".bulkinfer-complete"
COPY_CHUNK = 8 << 20


class ModelUnavailable(RuntimeError):
    """The model's files cannot be found or fetched; the message says where we looked."""


def model_cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "bulkinfer" / "models")


def local_model_dir(location: str, cache_dir: Path | None = None, *,
                    endpoint_url: str | None = None) -> Path:
    """A local directory holding the model at `location` (a path, `file://…` or `s3://…`)."""
    if not location.startswith("s3://"):
        path = Path(location.removeprefix("file://"))
        if not (path / "config.json").is_file():
            raise ModelUnavailable(f"no model at {location}: {path / 'config.json'} does not exist")
        return path
    return _downloaded(location, cache_dir or model_cache_dir(), endpoint_url)


def _downloaded(location: str, cache_dir: Path, endpoint_url: str | None) -> Path:
    prefix_uri = location.rstrip("/") + "/"
    digest = hashlib.sha256(prefix_uri.encode()).hexdigest()[:16]
    target = cache_dir / f"{prefix_uri.rstrip('/').rsplit('/', 1)[-1]}-{digest}"
    if (target / COMPLETE_MARKER).is_file():
        return target
    store, prefix = store_for_uri(prefix_uri, endpoint_url=endpoint_url)
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Download into a private folder and rename it into place, so two processes fetching the same
    # model at once never read each other's half-written files.
    staging = Path(tempfile.mkdtemp(prefix=".download-", dir=cache_dir))
    try:
        count = 0
        for info in store.list(prefix):
            relative = info.key[len(prefix):]
            if not relative or relative.endswith("/"):
                continue
            destination = staging / relative
            destination.parent.mkdir(parents=True, exist_ok=True)
            with store.open_read(info.key) as source, open(destination, "wb") as sink:
                shutil.copyfileobj(source, sink, COPY_CHUNK)
            count += 1
        if not (staging / "config.json").is_file():
            raise ModelUnavailable(f"no model at {location}: {count} object(s) there, none is config.json")
        (staging / COMPLETE_MARKER).write_text(location)
        if target.exists():  # an unfinished earlier download, or another process won the race
            if (target / COMPLETE_MARKER).is_file():
                return target
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.replace(staging, target)
        except OSError:
            if not (target / COMPLETE_MARKER).is_file():
                raise
        return target
    except ModelUnavailable:
        raise
    except Exception as error:
        if is_transient(error):  # the store is down for a moment: the task retries
            raise
        raise ModelUnavailable(f"cannot download the model at {location}: {error}") from error
    finally:
        shutil.rmtree(staging, ignore_errors=True)
