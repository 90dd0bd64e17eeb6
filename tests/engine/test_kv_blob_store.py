"""The prefix-KV store interface: write-once folder blobs, the disk cache in front of a back store,
keys that separate models/dtypes/ranks, and the torch-free catalog behind `bulkinfer kv ls|rm`."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from bulkinfer.engine.config import EngineConfig
from bulkinfer.engine.kv_connector.blob_store import (
    CachedBlobStore,
    KVBlobInfo,
    KVBlobStore,
    LocalFolderBlobStore,
)
from bulkinfer.engine.kv_connector.catalog import list_entries, remove
from bulkinfer.engine.kv_connector.keys import block_key, namespace
from bulkinfer.engine.kv_connector.model_identity import model_identity


def test_folder_store_is_write_once_and_reads_back(tmp_path) -> None:
    store = LocalFolderBlobStore(tmp_path)
    assert isinstance(store, KVBlobStore)
    assert store.get("kv/a/b") is None
    assert store.put_if_absent("kv/a/b", b"first") is True
    assert store.put_if_absent("kv/a/b", b"second") is False
    assert store.get("kv/a/b") == b"first"
    store.delete("kv/a/b")
    store.delete("kv/a/b")  # absent: no error
    assert store.get("kv/a/b") is None


def test_folder_store_concurrent_writers_one_wins_and_no_partial_files(tmp_path) -> None:
    store = LocalFolderBlobStore(tmp_path)
    results: list[bool] = []
    payloads = [bytes([i]) * 100_000 for i in range(8)]
    threads = [threading.Thread(target=lambda p=p: results.append(store.put_if_absent("kv/x", p)))
               for p in payloads]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results.count(True) == 1
    assert store.get("kv/x") in payloads
    assert [info.key for info in store.list("")] == ["kv/x"]


def test_folder_store_rejects_keys_that_escape_its_folder(tmp_path) -> None:
    store = LocalFolderBlobStore(tmp_path / "store")
    for key in ("../outside", "/abs", "kv/../../x", "", "kv//x"):
        with pytest.raises(ValueError, match="invalid blob key"):
            store.put_if_absent(key, b"x")
    assert not (tmp_path / "outside").exists()


def test_folder_store_list_reports_size_and_a_read_refreshes_last_use(tmp_path) -> None:
    store = LocalFolderBlobStore(tmp_path)
    store.put_if_absent("kv/ns/old", b"12345")
    store.put_if_absent("kv/ns/new", b"12")
    store.put_if_absent("other/x", b"1")
    os.utime(tmp_path / "kv/ns/old", (1000, 1000))
    os.utime(tmp_path / "kv/ns/new", (2000, 2000))
    infos = {info.key: info for info in store.list("kv/")}
    assert set(infos) == {"kv/ns/old", "kv/ns/new"}
    assert infos["kv/ns/old"].size == 5 and infos["kv/ns/old"].last_used == 1000
    store.get("kv/ns/old")
    infos = {info.key: info for info in store.list("kv/")}
    assert infos["kv/ns/old"].last_used > infos["kv/ns/new"].last_used


class CountingStore:
    """A back store that counts reads, and fails them while `down` (an outage)."""

    def __init__(self, inner: LocalFolderBlobStore) -> None:
        self.inner = inner
        self.gets = 0
        self.down = False

    def get(self, key: str) -> bytes | None:
        self.gets += 1
        if self.down:
            raise OSError("store unreachable")
        return self.inner.get(key)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        return self.inner.put_if_absent(key, data)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def list(self, prefix: str) -> Iterator[KVBlobInfo]:
        return self.inner.list(prefix)


def test_cached_store_reads_the_back_store_once_then_serves_from_disk(tmp_path) -> None:
    back = CountingStore(LocalFolderBlobStore(tmp_path / "back"))
    back.inner.put_if_absent("kv/k", b"payload")
    cached = CachedBlobStore(LocalFolderBlobStore(tmp_path / "front"), back, front_max_bytes=1 << 20)
    assert cached.get("kv/k") == b"payload"
    back.down = True  # served by the front folder now
    assert cached.get("kv/k") == b"payload"
    assert back.gets == 1


def test_cached_store_miss_during_an_outage_raises(tmp_path) -> None:
    back = CountingStore(LocalFolderBlobStore(tmp_path / "back"))
    cached = CachedBlobStore(LocalFolderBlobStore(tmp_path / "front"), back, front_max_bytes=1 << 20)
    back.down = True
    with pytest.raises(OSError, match="unreachable"):
        cached.get("kv/absent")


def test_cached_store_writes_both_and_keeps_the_front_under_its_cap(tmp_path) -> None:
    back = LocalFolderBlobStore(tmp_path / "back")
    front = LocalFolderBlobStore(tmp_path / "front")
    cached = CachedBlobStore(front, back, front_max_bytes=2500)
    for index in range(5):
        assert cached.put_if_absent(f"kv/ns/{index}", bytes(1000)) is True
        os.utime(tmp_path / "front/kv/ns" / str(index), (1000 + index, 1000 + index))
    assert cached.put_if_absent("kv/ns/0", b"other") is False
    assert len(list(back.list("kv/"))) == 5  # the back store keeps everything
    kept = sorted(info.key for info in front.list("kv/"))
    assert sum(info.size for info in front.list("")) <= 2500
    assert kept == ["kv/ns/3", "kv/ns/4"]  # the least recently used went first
    cached.delete("kv/ns/4")
    assert back.get("kv/ns/4") is None and front.get("kv/ns/4") is None


def test_namespace_separates_models_dtypes_ranks_block_sizes_and_kv_layouts() -> None:
    base = namespace("model-a", "bfloat16", 0, 1, 16)
    assert base.startswith("kv/") and base.endswith("/bf16/tp0of1/b16/hnd/")
    others = {namespace("model-b", "bfloat16", 0, 1, 16), namespace("model-a", "float32", 0, 1, 16),
              namespace("model-a", "bfloat16", 1, 2, 16), namespace("model-a", "bfloat16", 0, 1, 32),
              namespace("model-a", "bfloat16", 0, 1, 16, layout="nhd")}
    assert base not in others and len(others) == 5
    assert block_key(base, b"\x01\xff") == base + "01ff"
    with pytest.raises(ValueError, match="dtype"):
        namespace("m", "auto", 0, 1, 16)
    with pytest.raises(ValueError, match="rank"):
        namespace("m", "float32", 1, 1, 16)


def test_model_identity_follows_the_weights_not_the_folder(tiny_checkpoint, checkpoint_factory,
                                                           tmp_path) -> None:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(tiny_checkpoint, copy)
    assert model_identity(copy) == model_identity(tiny_checkpoint)
    assert model_identity(checkpoint_factory(seed=1)) != model_identity(tiny_checkpoint)
    for weights in copy.glob("*.safetensors"):
        weights.unlink()
    with pytest.raises(ValueError, match="no safetensors weights"):
        model_identity(copy)


def test_catalog_lists_per_namespace_and_removes_by_prefix(tmp_path) -> None:
    store = LocalFolderBlobStore(tmp_path)
    first = namespace("m1", "float32", 0, 1, 16)
    second = namespace("m2", "bfloat16", 0, 1, 16)
    for index in range(3):
        store.put_if_absent(block_key(first, bytes([index])), bytes(10))
    store.put_if_absent(block_key(second, b"\x00"), bytes(7))
    entries = {entry.namespace: entry for entry in list_entries(store)}
    assert set(entries) == {first, second}
    assert (entries[first].blocks, entries[first].bytes) == (3, 30)
    assert (entries[second].blocks, entries[second].bytes) == (1, 7)
    assert entries[first].last_used > 0
    assert remove(store, first) == 3
    assert [entry.namespace for entry in list_entries(store)] == [second]
    with pytest.raises(ValueError, match="must start with"):
        remove(store, "jobs/")


def test_catalog_imports_without_torch() -> None:
    code = ("import sys, bulkinfer.engine.kv_connector.catalog; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": os.getcwd()})


def test_engine_config_validates_the_kv_store_settings(tmp_path) -> None:
    store = LocalFolderBlobStore(tmp_path)
    EngineConfig(model="m", kv_store=store).validate()
    for kwargs, message in (
        ({"kv_store": object()}, "kv_store must be a KVBlobStore"),
        ({"kv_store": store, "enable_prefix_caching": False}, "needs enable_prefix_caching"),
        ({"kv_store": store, "tensor_parallel_size": 2}, "tensor_parallel_size"),
        ({"kv_store_min_hits": 0}, "kv_store_min_hits must be >= 1"),
        ({"kv_store_budget_bytes": 0}, "kv_store_budget_bytes must be >= 1"),
        ({"kv_store_min_tokens": -1}, "kv_store_min_tokens must be >= 0"),
        ({"kv_store_load_timeout_s": 0}, "kv_store_load_timeout_s"),
    ):
        with pytest.raises(ValueError, match=message):
            EngineConfig(model="m", **kwargs).validate()
