"""A flaky S3 (5xx, SlowDown, resets mid-upload, slow answers) through a fault-injecting proxy in
front of moto: every store call still succeeds, with the same bytes."""

from __future__ import annotations

import os
import time

import pytest

from bulkinfer.jobs.object_store.local import TEMP_PREFIX, LocalObjectStore
from bulkinfer.jobs.object_store.s3 import MIN_PART_SIZE, S3ObjectStore
from bulkinfer.jobs.orphan_uploads import SweepResult, sweep_orphan_uploads
from tests.fixtures.services import S3Server
from tests.support.s3_fault_proxy import FaultPlan, s3_fault_proxy

BUCKET = "flaky"


@pytest.fixture
def bucket(s3: S3Server) -> str:
    s3.client().create_bucket(Bucket=BUCKET)
    return BUCKET


def test_every_store_call_survives_injected_faults(s3: S3Server, bucket: str) -> None:
    plan = FaultPlan(["slowdown", "internal", "reset", "slow"], every=3, slow_s=0.2)
    with s3_fault_proxy(s3.endpoint_url, plan) as proxy:
        store = S3ObjectStore(bucket, endpoint_url=proxy.endpoint_url, part_size=MIN_PART_SIZE)
        payload = os.urandom(2 * MIN_PART_SIZE + 12345)  # three parts of a multipart upload
        with store.open_write("big/object.bin") as writer:
            for start in range(0, len(payload), 1 << 20):
                writer.write(payload[start:start + (1 << 20)])
        small = {f"small/{n}.json": f'{{"n": {n}}}'.encode() for n in range(12)}
        for key, data in small.items():
            store.put_bytes(key, data)
        assert store.get_bytes("big/object.bin") == payload
        assert store.head("big/object.bin").size == len(payload)
        assert store.read_range("big/object.bin", 100, 200) == payload[100:200]
        assert {key: store.get_bytes(key) for key in small} == small
        assert [info.key for info in store.list("small/")] == sorted(small)
    assert set(plan.injected) == {"slowdown", "internal", "reset", "slow"}


def test_uploads_a_killed_writer_left_are_aborted(s3: S3Server, bucket: str, tmp_path) -> None:  # noqa: ANN001
    client = s3.client()
    store = S3ObjectStore(bucket, endpoint_url=s3.endpoint_url)
    upload = client.create_multipart_upload(Bucket=bucket, Key="jobs/j1/output/part-00000.jsonl")
    client.upload_part(Bucket=bucket, Key="jobs/j1/output/part-00000.jsonl", UploadId=upload["UploadId"],
                       PartNumber=1, Body=b"x" * 100)
    client.create_multipart_upload(Bucket=bucket, Key="jobs/j2/output/part-00000.jsonl")  # another job's
    assert store.abort_unfinished_writes("jobs/j1/") == 1
    left = [u["Key"] for u in client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])]
    assert left == ["jobs/j2/output/part-00000.jsonl"]

    local = LocalObjectStore(tmp_path)
    local.put_bytes("jobs/j1/output/part-00000.jsonl", b"kept")
    (tmp_path / "jobs/j1/output" / f"{TEMP_PREFIX}abc").write_bytes(b"half a part")
    assert local.abort_unfinished_writes("jobs/j1/") == 1
    assert sorted(p.name for p in (tmp_path / "jobs/j1/output").iterdir()) == ["part-00000.jsonl"]


@pytest.mark.parametrize("kind", ["s3", "local"])
def test_uploads_that_never_became_a_job_are_swept_once_old(s3: S3Server, tmp_path, kind: str) -> None:  # noqa: ANN001
    local = LocalObjectStore(tmp_path)
    store = S3ObjectStore(BUCKET, endpoint_url=s3.endpoint_url) if kind == "s3" else local
    if kind == "s3":
        s3.client().create_bucket(Bucket=BUCKET)
    store.put_bytes("p/jobs/job-real/job.json", b"{}")
    store.put_bytes("p/jobs/job-real/input/rows.jsonl", b"kept: a job reads it")
    store.put_bytes("p/jobs/job-orphan/input/rows.jsonl", b"the API died before job.json")
    writer = store.open_write("p/jobs/job-half/input/big.jsonl")  # still streaming, or killed
    writer.write(b"x" * 10)
    if kind == "s3":  # an S3 upload becomes a multipart upload once it passes one part
        s3.client().create_multipart_upload(Bucket=BUCKET, Key="p/jobs/job-half/input/big.jsonl")
    # moto dates every multipart upload 2010: measure "too young" from the dates the store reports.
    [write] = store.unfinished_writes("p/jobs/")
    young = min(time.time(), write.started + 60)
    assert sweep_orphan_uploads(store, "p", now=young) == SweepResult(0, 0)  # all too young to tell
    later = time.time() + 7 * 3600
    assert sweep_orphan_uploads(store, "p", now=later) == SweepResult(1, 1)
    keys = [info.key for info in store.list("p/")]
    assert keys == ["p/jobs/job-real/input/rows.jsonl", "p/jobs/job-real/job.json"]
    assert store.unfinished_writes("p/jobs/") == []


@pytest.mark.parametrize("kind", ["s3", "local"])
def test_v1_file_uploads_that_never_got_their_record_are_swept_once_old(s3: S3Server, tmp_path,  # noqa: ANN001
                                                                        kind: str) -> None:
    store = LocalObjectStore(tmp_path)
    if kind == "s3":
        s3.client().create_bucket(Bucket=BUCKET)
        store = S3ObjectStore(BUCKET, endpoint_url=s3.endpoint_url)
    store.put_bytes("p/files/acme/file-kept/content", b"an uploaded file")
    store.put_bytes("p/files/acme/file-kept/meta.json", b"{}")
    store.put_bytes("p/files/_open/file-orphan/content", b"the API died before meta.json")
    writer = store.open_write("p/files/acme/file-half/content")  # still streaming, or killed
    writer.write(b"x" * 10)
    if kind == "s3":
        s3.client().create_multipart_upload(Bucket=BUCKET, Key="p/files/acme/file-half/content")
    [write] = store.unfinished_writes("p/files/")
    young = min(time.time(), write.started + 60)
    assert sweep_orphan_uploads(store, "p", now=young) == SweepResult()  # all too young to tell
    assert sweep_orphan_uploads(store, "p", now=time.time() + 7 * 3600) == \
        SweepResult(files_removed=1, file_writes_aborted=1)
    keys = [info.key for info in store.list("p/")]
    assert keys == ["p/files/acme/file-kept/content", "p/files/acme/file-kept/meta.json"]
    assert store.unfinished_writes("p/files/") == []
