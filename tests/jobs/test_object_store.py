"""The ObjectStore contract, run against moto S3 and against a local directory."""

from __future__ import annotations

import hashlib
import os
import stat
from urllib.request import urlopen

import httpx
import pytest

from bulkinfer.jobs.object_store import (
    AlreadyExists,
    LocalObjectStore,
    ObjectNotFound,
    S3ObjectStore,
    split_uri,
    store_for_uri,
)


def test_put_get_head_and_exists(store) -> None:
    info = store.put_bytes("a/b.txt", b"hello")
    assert info.size == 5
    assert store.get_bytes("a/b.txt") == b"hello"
    assert store.head("a/b.txt").size == 5
    assert store.exists("a/b.txt")
    assert not store.exists("a/c.txt")
    with pytest.raises(ObjectNotFound):
        store.get_bytes("a/c.txt")
    with pytest.raises(ObjectNotFound):
        store.head("a/c.txt")


def test_write_once_refuses_a_second_write_and_keeps_the_first(store) -> None:
    store.put_bytes("part", b"first", if_none_match=True)
    with pytest.raises(AlreadyExists):
        store.put_bytes("part", b"second", if_none_match=True)
    assert store.get_bytes("part") == b"first"
    store.put_bytes("part", b"overwrite")  # a plain put still replaces
    assert store.get_bytes("part") == b"overwrite"


def test_put_once_or_same_accepts_identical_bytes_only(store) -> None:
    assert store.put_once_or_same("manifest.json", b"{}") is True
    assert store.put_once_or_same("manifest.json", b"{}") is False
    with pytest.raises(AlreadyExists):
        store.put_once_or_same("manifest.json", b"{\"other\": 1}")


def test_range_reads_are_end_exclusive_and_clipped(store) -> None:
    data = bytes(range(256)) * 4
    store.put_bytes("blob", data)
    assert store.read_range("blob", 0, 10) == data[:10]
    assert store.read_range("blob", 100, 300) == data[100:300]
    assert store.read_range("blob", 1000, 5000) == data[1000:]
    assert store.read_range("blob", 2000, 3000) == b""
    assert store.read_range("blob", 5, 5) == b""
    with store.open_read("blob", start=1020) as stream:
        assert stream.read() == data[1020:]


def test_seekable_file_reads_like_a_local_file(store) -> None:
    data = os.urandom(3000)
    store.put_bytes("blob", data)
    with store.open_seekable("blob") as file:
        file.seek(-8, os.SEEK_END)
        assert file.read() == data[-8:]
        file.seek(100)
        assert file.read(50) == data[100:150]


def test_streaming_write_larger_than_one_multipart_part(store) -> None:
    chunk = os.urandom(1024 * 1024)
    total = 11 * len(chunk) + 12345  # three 5 MiB parts on S3, the last one short
    expected = hashlib.sha256()
    with store.open_write("big/output.bin") as writer:
        for _ in range(11):
            writer.write(chunk)
            expected.update(chunk)
        writer.write(chunk[:12345])
        expected.update(chunk[:12345])
    assert writer.size == total
    assert store.head("big/output.bin").size == total
    with store.open_read("big/output.bin") as stream:
        digest = hashlib.sha256()
        while block := stream.read(1 << 20):
            digest.update(block)
    assert digest.hexdigest() == expected.hexdigest()


def test_streaming_write_is_invisible_until_closed_and_dropped_on_error(store) -> None:
    with pytest.raises(RuntimeError):
        with store.open_write("partial") as writer:
            writer.write(os.urandom(6 * 1024 * 1024))
            assert not store.exists("partial")
            raise RuntimeError("worker died mid-write")
    assert not store.exists("partial")
    assert list(store.list("")) == []


def test_streaming_write_once_refuses_an_existing_key(store) -> None:
    store.put_bytes("part", b"first")
    for size in (10, 6 * 1024 * 1024):  # the single-PUT path and the multipart path
        with pytest.raises(AlreadyExists):
            with store.open_write("part", if_none_match=True) as writer:
                writer.write(b"x" * size)
        assert store.get_bytes("part") == b"first"


def test_list_pages_through_every_key_in_order(store) -> None:
    keys = [f"jobs/j1/output/part-{index:05d}.jsonl" for index in range(10)]
    for key in reversed(keys):
        store.put_bytes(key, b"x")
    store.put_bytes("jobs/j10/job.json", b"{}")
    store.put_bytes("jobs/j1/job.json", b"{}")
    # The S3 fixture lists 3 keys a page, so ten keys take four pages.
    assert [info.key for info in store.list("jobs/j1/output/")] == keys
    assert [info.key for info in store.list("jobs/j1/")] == ["jobs/j1/job.json", *keys]
    assert {info.key for info in store.list("jobs/j1")} == {"jobs/j1/job.json", "jobs/j10/job.json", *keys}


def test_copy_replaces_the_target_and_refuses_a_missing_source(store) -> None:
    data = os.urandom(9 << 20)  # past boto3's multipart-copy threshold (8 MiB)
    store.put_bytes("staged/part", data)
    store.put_bytes("part", b"old")
    store.copy("staged/part", "part")
    assert hashlib.sha256(store.get_bytes("part")).digest() == hashlib.sha256(data).digest()
    assert store.get_bytes("staged/part") == data  # the source stays
    with pytest.raises(ObjectNotFound):
        store.copy("no/such", "other")
    assert not store.exists("other")


def test_delete_is_idempotent(store) -> None:
    store.put_bytes("k", b"v")
    store.delete("k")
    store.delete("k")
    assert not store.exists("k")


def test_presigned_get_returns_the_bytes(store) -> None:
    store.put_bytes("out/part-00000.jsonl", b"{\"id\": 1}\n")
    url = store.presign_get("out/part-00000.jsonl", expires=60)
    if url.startswith("file://"):
        with urlopen(url) as response:
            assert response.read() == b"{\"id\": 1}\n"
    else:
        assert httpx.get(url).content == b"{\"id\": 1}\n"


def test_s3_endpoint_comes_from_the_environment(s3, s3_store) -> None:
    s3_store.put_bytes("k", b"v")
    store = S3ObjectStore(s3_store.bucket)  # no client, no endpoint: BULKINFER_S3_ENDPOINT_URL
    assert store.client.meta.endpoint_url == s3.endpoint_url
    assert store.get_bytes("k") == b"v"


def test_store_for_uri(s3, s3_store, tmp_path) -> None:
    s3_store.put_bytes("in/rows.jsonl", b"{}\n")
    store, key = store_for_uri(f"s3://{s3_store.bucket}/in/rows.jsonl")
    assert isinstance(store, S3ObjectStore) and key == "in/rows.jsonl"
    assert store.get_bytes(key) == b"{}\n"

    local_file = tmp_path / "rows.jsonl"
    local_file.write_bytes(b"{}\n")
    for uri in (str(local_file), local_file.as_uri()):
        store, key = store_for_uri(uri)
        assert isinstance(store, LocalObjectStore)
        assert store.get_bytes(key) == b"{}\n"
        assert store.uri(key) == local_file.as_uri()


@pytest.mark.parametrize("uri, problem", [
    ("gs://bucket/key", "unsupported URI scheme"),
    ("s3:///key", "has no bucket"),
    ("relative/path.jsonl", "must be absolute"),
    ("file://remote-host/path", "must be local"),
])
def test_split_uri_rejects_what_it_cannot_open(uri, problem) -> None:
    with pytest.raises(ValueError, match=problem):
        split_uri(uri)


def test_local_keys_cannot_escape_the_root(local_store) -> None:
    with pytest.raises(ValueError, match="escapes"):
        local_store.put_bytes("../outside", b"x")


def _record_fsyncs(monkeypatch) -> list[tuple[int, bool]]:
    """(inode, is a folder) of everything fsynced, in order."""
    synced: list[tuple[int, bool]] = []
    real_fsync = os.fsync

    def fsync(descriptor: int) -> None:
        info = os.fstat(descriptor)
        synced.append((info.st_ino, stat.S_ISDIR(info.st_mode)))
        real_fsync(descriptor)

    monkeypatch.setattr(os, "fsync", fsync)
    return synced


@pytest.mark.parametrize("write_once", [True, False])
def test_local_commits_are_fsynced_with_their_folders(local_store, monkeypatch, write_once) -> None:
    """A committed object survives a power loss: its bytes are on disk before it gets its name, and
    the folders holding its name (and the folders the write created) are synced after."""
    local_store.put_bytes("jobs/old/x", b"existing folder")
    synced = _record_fsyncs(monkeypatch)

    local_store.put_bytes("jobs/job-1/shards/result-00000.json", b"{}", if_none_match=write_once)

    target = local_store.path("jobs/job-1/shards/result-00000.json")
    file_sync = (target.stat().st_ino, False)
    folder_syncs = {(folder.stat().st_ino, True) for folder in
                    (target.parent, target.parent.parent, local_store.path("jobs"))}
    assert file_sync in synced
    assert folder_syncs <= set(synced)
    assert synced.index(file_sync) < min(synced.index(entry) for entry in folder_syncs)

