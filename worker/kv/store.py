"""The prefix KV tier a worker's engines get, from the settings: blocks in the object store (the job
store's `kv/` area unless `kv_store_uri` says elsewhere), behind a disk cache on this machine
(`<model_cache>/kv/` unless `kv_store_cache_dir` says elsewhere).

On for deployments whose store is a bucket (`kv_store = "auto"`), off for `bulkinfer run` unless
asked. The S3 client here gives up fast (two attempts, short timeouts): a block that does not come
back in time is computed, so a slow or unreachable store must cost seconds, never a shard's minutes.
"""

from __future__ import annotations

import logging
from typing import Any

from bulkinfer.jobs.object_store.s3 import make_s3_client
from bulkinfer.jobs.settings import Settings
from bulkinfer.worker.kv.blob_store import ObjectStoreBlobStore

logger = logging.getLogger(__name__)

KV_S3_ATTEMPTS = 2
KV_S3_CONNECT_TIMEOUT_S = 2.0
KV_S3_READ_TIMEOUT_S = 5.0


def open_kv_blobs(settings: Settings, *, fail_fast: bool = True) -> ObjectStoreBlobStore:
    """The store the KV blocks live in (no disk cache): what `bulkinfer kv` reads and the engines'
    tier writes to. `fail_fast`: the workers' short-timeout S3 client (the CLI waits longer)."""
    client = None
    if fail_fast and settings.kv_store_location.startswith("s3://"):
        client = make_s3_client(settings.s3_endpoint_url, max_attempts=KV_S3_ATTEMPTS,
                                connect_timeout_s=KV_S3_CONNECT_TIMEOUT_S,
                                read_timeout_s=KV_S3_READ_TIMEOUT_S)
    store, prefix = settings.open_kv_store(client)
    return ObjectStoreBlobStore(store, prefix)


def kv_store_options(settings: Settings, *, deployment: bool) -> dict[str, Any]:
    """The `EngineConfig` fields of the KV tier ({} when it is off): `deployment` is True for a
    worker (`serve worker`, `up`), False for `bulkinfer run`."""
    if not settings.kv_store_enabled(deployment=deployment):
        return {}
    engine = settings.engine_options_dict()
    unsupported = _unsupported_by_engines(engine)
    if unsupported is not None and settings.kv_store == "auto":
        logger.info("prefix KV store off: %s", unsupported)
        return {}  # "on" goes on: the engine refuses it at load, naming the reason
    from bulkinfer.engine.kv_connector.blob_store import CachedBlobStore, LocalFolderBlobStore

    blobs: Any = open_kv_blobs(settings)
    # A disk cache in front of a bucket; a local store already is a folder on this machine.
    if settings.kv_cache_bytes > 0 and settings.kv_store_location.startswith("s3://"):
        try:
            front = LocalFolderBlobStore(settings.kv_cache_dir)
        except OSError as error:  # a read-only or full disk: the bucket alone still serves
            logger.warning("prefix KV disk cache off: cannot use %s (%s)", settings.kv_cache_dir, error)
        else:
            blobs = CachedBlobStore(front, blobs, settings.kv_cache_bytes)
    options: dict[str, Any] = {"kv_store": blobs, "kv_store_min_hits": settings.kv_min_hits}
    if settings.kv_store_budget_bytes is not None:
        options["kv_store_budget_bytes"] = settings.kv_store_budget_bytes
    return options


def _unsupported_by_engines(engine_options: dict[str, Any]) -> str | None:
    """Why these engines cannot have the tier (its keys are the prefix cache's hashes, one rank's)."""
    if engine_options.get("enable_prefix_caching") is False:
        return "engine_options turn enable_prefix_caching off"
    if int(engine_options.get("tensor_parallel_size") or 1) > 1:
        return "tensor-parallel engines do not save or load prefix KV yet"
    speculative = engine_options.get("speculative_config")
    if isinstance(speculative, dict) and speculative.get("method") == "draft_model":
        return "a draft model's KV is not stored, so engines speculating with one cannot load blocks"
    return None
