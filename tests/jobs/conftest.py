"""Shared fixtures for jobs/ tests: one object-store contract, two implementations."""

from __future__ import annotations

import pytest

from bulkinfer.jobs.object_store import LocalObjectStore, ObjectStore, S3ObjectStore

BUCKET = "bulkinfer-test"


@pytest.fixture
def s3_store(s3) -> S3ObjectStore:
    s3.client().create_bucket(Bucket=BUCKET)
    return S3ObjectStore(BUCKET, client=s3.client(), part_size=5 * 1024 * 1024, list_page_size=3)


@pytest.fixture
def local_store(tmp_path) -> LocalObjectStore:
    return LocalObjectStore(tmp_path / "store")


@pytest.fixture(params=["s3", "local"])
def store(request) -> ObjectStore:
    """Each test that takes `store` runs against moto S3 and against a local directory."""
    return request.getfixturevalue(f"{request.param}_store")
