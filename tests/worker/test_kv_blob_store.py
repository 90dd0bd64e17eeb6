"""The prefix KV tier's store adapter (worker/kv/blob_store.py) over a local folder and moto S3,
and what the settings make of it (worker/kv/store.py): write-once blocks under the store's `kv/`,
an outage that raises fast (the engine then computes), the tier only where the settings turn it on."""

from __future__ import annotations

import time

import pytest

from bulkinfer.engine.kv_connector.blob_store import CachedBlobStore, KVBlobInfo
from bulkinfer.jobs.object_store import LocalObjectStore, S3ObjectStore
from bulkinfer.jobs.settings import Settings
from bulkinfer.worker.kv.blob_store import ObjectStoreBlobStore
from bulkinfer.worker.kv.store import kv_store_options, open_kv_blobs
from tests.fixtures.services import S3Server, free_port

BLOCK = "kv/0f1e2d/fp32/tp0of1/b16/" + "ab" * 16
OTHER = "kv/0f1e2d/fp32/tp0of1/b16/" + "cd" * 16


@pytest.fixture(params=["local", "s3"])
def blobs(request: pytest.FixtureRequest, tmp_path) -> ObjectStoreBlobStore:
    if request.param == "local":
        return ObjectStoreBlobStore(LocalObjectStore(tmp_path / "store"), "team/prod")
    s3: S3Server = request.getfixturevalue("s3")
    s3.client().create_bucket(Bucket="jobs")
    return ObjectStoreBlobStore(S3ObjectStore("jobs", endpoint_url=s3.endpoint_url), "team/prod")


def test_a_block_is_written_once_under_the_store_prefix_and_read_back(blobs: ObjectStoreBlobStore) -> None:
    assert blobs.get(BLOCK) is None  # absent: computed, not an error
    assert blobs.put_if_absent(BLOCK, b"first") is True
    assert blobs.put_if_absent(BLOCK, b"second") is False  # another worker saved it first: kept
    assert blobs.get(BLOCK) == b"first"
    assert blobs.store.get_bytes(f"team/prod/{BLOCK}") == b"first"  # beside the jobs, in kv/
    blobs.delete(BLOCK)
    assert blobs.get(BLOCK) is None
    blobs.delete(BLOCK)  # deleting twice is no error


def test_listing_gives_the_engines_keys_sizes_and_write_times(blobs: ObjectStoreBlobStore) -> None:
    before = time.time() - 5
    blobs.put_if_absent(BLOCK, b"x" * 10)
    blobs.put_if_absent(OTHER, b"y" * 3)
    blobs.store.put_bytes("team/prod/jobs/j1/job.json", b"{}")  # not a block
    listed = sorted(blobs.list("kv/"), key=lambda info: info.key)
    assert [(info.key, info.size) for info in listed] == [(BLOCK, 10), (OTHER, 3)]
    assert all(isinstance(info, KVBlobInfo) and info.last_used >= before for info in listed)
    assert list(blobs.list("kv/ffff/")) == []


def test_a_store_that_is_down_raises_within_seconds_instead_of_answering_absent() -> None:
    dead = Settings(store_uri="s3://jobs/prod", s3_endpoint_url=f"http://127.0.0.1:{free_port()}",
                    kv_store="on")
    blobs = open_kv_blobs(dead)
    started = time.monotonic()
    with pytest.raises(Exception) as raised:  # noqa: PT011 - any error: the engine computes the block
        blobs.get(BLOCK)
    assert "Connect" in type(raised.value).__name__ or "connect" in str(raised.value).lower()
    assert time.monotonic() - started < 15  # the job store's client would retry for minutes


def test_the_settings_give_the_engines_the_tier_only_where_it_is_on(tmp_path, s3: S3Server) -> None:
    local = Settings(store_uri=str(tmp_path / "store"), model_cache=str(tmp_path / "models"))
    assert kv_store_options(local, deployment=True) == {}  # auto, no bucket
    bucket = Settings(store_uri="s3://jobs/prod", s3_endpoint_url=s3.endpoint_url,
                      model_cache=str(tmp_path / "models"), kv_store_min_hits=3)
    assert kv_store_options(bucket, deployment=False) == {}  # auto: off for bulkinfer run
    options = kv_store_options(bucket, deployment=True)
    assert options["kv_store_min_hits"] == 3 and "kv_store_budget_bytes" not in options
    assert isinstance(options["kv_store"], CachedBlobStore)  # a disk cache in front of the bucket
    on_locally = local.model_copy(update={"kv_store": "on", "kv_store_budget_bytes": 1 << 20})
    options = kv_store_options(on_locally, deployment=False)
    tier = options["kv_store"]
    assert isinstance(tier, ObjectStoreBlobStore) and options["kv_store_budget_bytes"] == 1 << 20
    tier.put_if_absent(BLOCK, b"z")
    assert (tmp_path / "store" / BLOCK).read_bytes() == b"z"
    tensor_parallel = bucket.model_copy(update={"tensor_parallel_size": 2})
    assert kv_store_options(tensor_parallel, deployment=True) == {}  # auto: TP engines have no tier yet
    drafting = bucket.model_copy(update={"speculative_config": '{"method": "draft_model", "model": "d"}'})
    assert kv_store_options(drafting, deployment=True) == {}  # a draft model's KV is not stored
    no_cache = bucket.model_copy(update={"kv_store_cache_bytes": 0})
    assert isinstance(kv_store_options(no_cache, deployment=True)["kv_store"], ObjectStoreBlobStore)
    (tmp_path / "read-only").write_text("")  # a file where the cache folder would go: no cache, no crash
    unwritable = bucket.model_copy(update={"kv_store_cache_dir": str(tmp_path / "read-only" / "kv")})
    assert isinstance(kv_store_options(unwritable, deployment=True)["kv_store"], ObjectStoreBlobStore)
