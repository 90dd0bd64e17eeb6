"""What the job side can tell of a served model from its checkpoint's config.json, read where the model
lives (a local folder, or an s3:// folder through the object store), without the engine: a quantized
checkpoint in a scheme the engine does not run is refused when the job is submitted, naming the scheme
(bulkinfer/quant_scheme.py), before any worker tries to load it. A location the API cannot read (a
catalog name or preset the workers resolve, a store that is down) is not refused here: the workers'
load errors still are (jobs/workers.py `unservable_reason`)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from bulkinfer.jobs.object_store.base import ObjectStore
from bulkinfer.quant_scheme import UnsupportedQuantization, read_quantization

CACHE_SECONDS = 60.0  # a model folder is rarely rewritten; a restart (or a minute) sees a new one
_cache: dict[str, tuple[float, str | None]] = {}


def checkpoint_refusal(location: str, s3_store: Callable[[str], ObjectStore]) -> str | None:
    """Why the checkpoint at `location` cannot run (its quantization scheme), or None (it can, or
    its config.json is not readable from here). `s3_store(bucket)`: the store of an s3:// location."""
    now = time.monotonic()
    cached = _cache.get(location)
    if cached is not None and now - cached[0] < CACHE_SECONDS:
        return cached[1]
    config = _read_config(location, s3_store)
    reason = None
    if config is not None:
        try:
            read_quantization(config)
        except UnsupportedQuantization as error:
            reason = f"its checkpoint is quantized ({error})"
    _cache[location] = (now, reason)
    return reason


def _read_config(location: str, s3_store: Callable[[str], ObjectStore]) -> dict | None:
    try:
        if location.startswith("s3://"):
            bucket, _, prefix = location.removeprefix("s3://").partition("/")
            key = f"{prefix.rstrip('/')}/config.json" if prefix else "config.json"
            data = s3_store(bucket).get_bytes(key)
        else:
            path = Path(location.removeprefix("file://")).expanduser() / "config.json"
            if not path.is_file():
                return None
            data = path.read_bytes()
        config = json.loads(data)
    except Exception:  # noqa: BLE001 - unreadable from here: the workers will say
        return None
    return config if isinstance(config, dict) else None
