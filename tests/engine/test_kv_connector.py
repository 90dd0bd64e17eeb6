"""Prefix KV saved to a store by one engine and loaded by another: greedy outputs identical to
computing it (fp32 and bf16), damaged blocks detected and recomputed, outages and slow loads
falling back to computing without holding other rows, tenants never sharing, and the policy
(shared-by-min_hits, break-even length, byte budget)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bulkinfer.engine import LLM, SamplingParams
from bulkinfer.engine.kv_connector.blob_store import KVBlobInfo, LocalFolderBlobStore
from bulkinfer.engine.kv_connector.policy import delete_past_budget

BLOCK = 16
PREFIX = [5 + (i * 7) % 500 for i in range(100)]  # 6 full blocks, then each row's own tokens
PROMPTS = [PREFIX + [600 + row, 700 + row, 800 + row] for row in range(4)]
GREEDY = SamplingParams(max_tokens=8, temperature=0)


class WatchedStore:
    """A folder store that counts reads and can fail them, after `fail_after` reads, or hold each
    read until `release` is set."""

    def __init__(self, root: Path) -> None:
        self.inner = LocalFolderBlobStore(root)
        self.gets = 0
        self.fail_after: int | None = None
        self.release: threading.Event | None = None

    def get(self, key: str) -> bytes | None:
        self.gets += 1
        if self.release is not None:
            self.release.wait(30)
        if self.fail_after is not None and self.gets > self.fail_after:
            raise ConnectionError("store unreachable")
        return self.inner.get(key)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        return self.inner.put_if_absent(key, data)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def list(self, prefix: str) -> Iterator[KVBlobInfo]:
        return self.inner.list(prefix)


def engine(model: Path, store, dtype: str = "float32", **kwargs) -> LLM:
    options = {"kv_store_min_tokens": 0, **kwargs}
    return LLM(str(model), dtype=dtype, num_kv_blocks=64, kv_populate_seconds=0, kv_store=store, **options)


def generate(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in llm.generate(prompts, GREEDY)]


def fill(model: Path, store, dtype: str = "float32", prompts=PROMPTS, **kwargs) -> list[list[int]]:
    """One engine computes the prompts and saves their shared blocks."""
    writer = engine(model, store, dtype, **kwargs)
    outputs = generate(writer, prompts)
    writer.engine.kv_connector.wait_saved()
    return outputs


def block_files(root: Path) -> list[Path]:
    return sorted(path for path in root.rglob("*") if path.is_file())


@pytest.fixture(scope="module")
def computed(tiny_checkpoint) -> dict[str, list[list[int]]]:
    """Greedy outputs without any store, per dtype."""
    return {dtype: generate(LLM(str(tiny_checkpoint), dtype=dtype, num_kv_blocks=64, kv_populate_seconds=0))
            for dtype in ("float32", "bfloat16")}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_outputs_with_loaded_prefix_equal_computed(tiny_checkpoint, tmp_path, computed, dtype) -> None:
    store = LocalFolderBlobStore(tmp_path)
    assert fill(tiny_checkpoint, store, dtype) == computed[dtype]
    assert len(block_files(tmp_path)) == len(PREFIX) // BLOCK  # the shared blocks, not the rows' own
    reader = engine(tiny_checkpoint, store, dtype)
    outputs = reader.generate(PROMPTS, GREEDY)
    assert [output.outputs[0].token_ids for output in outputs] == computed[dtype]
    stats = reader.engine.kv_store_stats()
    assert stats["hits_blocks"] == len(PREFIX) // BLOCK
    assert stats["loaded_bytes"] == sum(path.stat().st_size for path in block_files(tmp_path))
    assert stats["saved_blocks"] == 0  # already there: written once
    # Every row's prefix came from the store (the first) or from what it loaded (the others).
    assert all(output.num_cached_tokens == 96 for output in outputs)


def test_loaded_blocks_of_another_dtype_are_not_used(tiny_checkpoint, tmp_path) -> None:
    store = LocalFolderBlobStore(tmp_path)
    fill(tiny_checkpoint, store, "float32")
    reader = engine(tiny_checkpoint, store, "bfloat16")
    generate(reader)
    assert reader.engine.kv_store_stats()["hits_blocks"] == 0


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_block_is_detected_counted_deleted_and_recomputed(tiny_checkpoint, tmp_path, computed,
                                                                  damage) -> None:
    store = LocalFolderBlobStore(tmp_path)
    fill(tiny_checkpoint, store)
    writer_blocks = {path.name for path in block_files(tmp_path)}
    reader = engine(tiny_checkpoint, store)
    # The chain's third block: found by loading one engine's blocks in order.
    third = _chain_keys(reader, tmp_path)[2]
    data = third.read_bytes()
    damaged = data[: len(data) // 2] if damage == "truncate" else data[:-1] + bytes([data[-1] ^ 0xFF])
    third.write_bytes(damaged)
    assert generate(reader) == computed["float32"]
    stats = reader.engine.kv_store_stats()
    assert stats["corrupt_blocks"] == 1
    assert stats["hits_blocks"] == 2  # the blocks before it; the rest was computed
    reader.engine.kv_connector.wait_saved()
    # Recomputed and saved again: the store holds a good block under that key.
    assert {path.name for path in block_files(tmp_path)} == writer_blocks
    assert third.read_bytes() == data


def _chain_keys(llm: LLM, root: Path) -> list[Path]:
    """The store files of PREFIX's blocks, in chain order."""
    from bulkinfer.engine.kv_connector.keys import block_key
    from bulkinfer.engine.request import Request

    manager = llm.engine.scheduler.kv_cache_manager
    request = Request("probe", PROMPTS[0], GREEDY)
    namespace = llm.engine.kv_connector.namespace
    return [root / block_key(namespace, h) for h in manager.block_hashes(request)[: len(PREFIX) // BLOCK]]


def test_store_outage_mid_load_falls_back_to_computing(tiny_checkpoint, tmp_path, computed) -> None:
    store = WatchedStore(tmp_path)
    fill(tiny_checkpoint, store)
    store.gets, store.fail_after = 0, 2  # the third read on fails
    reader = engine(tiny_checkpoint, store)
    reader.engine.kv_connector._pool._max_workers = 1  # reads in chain order
    assert generate(reader) == computed["float32"]
    stats = reader.engine.kv_store_stats()
    assert stats["failed_loads"] == 1
    assert stats["hits_blocks"] == 2


def test_slow_load_times_out_and_other_rows_keep_running(tiny_checkpoint, tmp_path, computed) -> None:
    store = WatchedStore(tmp_path)
    fill(tiny_checkpoint, store)
    store.release = threading.Event()  # every read hangs until released
    reader = engine(tiny_checkpoint, store, kv_store_load_timeout_s=2.0)
    other = [900 + i for i in range(10)]  # too short for a lookup: runs at once
    llm_engine = reader.engine
    for index, prompt in enumerate([PROMPTS[0], other]):
        llm_engine.add_request(str(index), prompt, GREEDY)
    finished_at: dict[str, float] = {}
    started = time.monotonic()
    while llm_engine.has_unfinished_requests():
        for output in llm_engine.step():
            finished_at[output.request_id] = time.monotonic() - started
            assert output.finish_reason == "length"
    store.release.set()
    # The short row ran while the other waited for its reads; that one gave up at the timeout.
    assert finished_at["1"] < finished_at["0"]
    assert 2.0 <= finished_at["0"] < 25
    assert llm_engine.kv_store_stats()["failed_loads"] == 1
    llm_engine.add_request("again", PROMPTS[0], GREEDY)
    assert [o.token_ids for o in _drain(llm_engine)] == [computed["float32"][0]]


def _drain(llm_engine) -> list:
    outputs = []
    while llm_engine.has_unfinished_requests():
        outputs += llm_engine.step()
    return outputs


def _run_salted(llm: LLM, salt: str) -> list[list[int]]:
    for index, prompt in enumerate(PROMPTS):
        llm.engine.add_request(f"{salt}-{index}", prompt, GREEDY, cache_salt=salt)
    return [output.token_ids for output in sorted(_drain(llm.engine), key=lambda o: o.request_id)]


def test_two_tenants_with_the_same_prefix_never_load_each_others_blocks(tiny_checkpoint, tmp_path,
                                                                        computed) -> None:
    store = WatchedStore(tmp_path)
    writer = engine(tiny_checkpoint, store)
    assert _run_salted(writer, "tenant-a") == computed["float32"]
    writer.engine.kv_connector.wait_saved()
    saved = block_files(tmp_path)
    other = engine(tiny_checkpoint, store)
    assert _run_salted(other, "tenant-b") == computed["float32"]
    assert other.engine.kv_store_stats()["hits_blocks"] == 0
    same = engine(tiny_checkpoint, store)
    assert _run_salted(same, "tenant-a") == computed["float32"]
    assert same.engine.kv_store_stats()["hits_blocks"] == len(PREFIX) // BLOCK
    other.engine.kv_connector.wait_saved()
    # tenant-b's blocks are its own keys: twice the files, none shared.
    assert len(block_files(tmp_path)) == 2 * len(saved)


def test_prefix_of_a_single_row_is_not_saved_until_min_hits_rows_share_it(tiny_checkpoint, tmp_path) -> None:
    store = LocalFolderBlobStore(tmp_path)
    fill(tiny_checkpoint, store, prompts=PROMPTS[:1])
    assert block_files(tmp_path) == []
    fill(tiny_checkpoint, store, prompts=PROMPTS[:1], kv_store_min_hits=1)
    assert len(block_files(tmp_path)) == len(PREFIX) // BLOCK


def test_prefix_shorter_than_the_break_even_is_not_looked_up(tiny_checkpoint, tmp_path, computed) -> None:
    store = WatchedStore(tmp_path)
    fill(tiny_checkpoint, store)
    store.gets = 0
    reader = engine(tiny_checkpoint, store, kv_store_min_tokens=len(PREFIX) + BLOCK)
    assert generate(reader) == computed["float32"]
    assert store.gets == 0
    assert reader.engine.kv_store_stats()["hits_blocks"] == 0


def test_store_kept_under_its_budget_least_recently_used_deleted_first(tiny_checkpoint, tmp_path) -> None:
    store = LocalFolderBlobStore(tmp_path)
    fill(tiny_checkpoint, store)
    one_block = block_files(tmp_path)[0].stat().st_size
    budget = 3 * one_block
    other_prefix = [[1000 + i for i in range(100)] + [row] for row in range(2)]
    writer = engine(tiny_checkpoint, store, kv_store_budget_bytes=budget)
    generate(writer, other_prefix)
    writer.engine.kv_connector.wait_saved()
    files = block_files(tmp_path)
    assert sum(path.stat().st_size for path in files) <= budget
    assert writer.engine.kv_store_stats()["stored_bytes"] <= budget
    # The newest prefix's blocks are the ones kept.
    reader = engine(tiny_checkpoint, store)
    generate(reader, other_prefix)
    assert reader.engine.kv_store_stats()["hits_blocks"] >= 1


def test_budget_pass_deletes_by_last_use_including_uses_the_store_did_not_record(tmp_path) -> None:
    store = LocalFolderBlobStore(tmp_path)
    for index, name in enumerate(["a", "b", "c", "d"]):
        store.put_if_absent(f"kv/ns/{name}", bytes(100))
        os.utime(tmp_path / "kv/ns" / name, (1000 + index, 1000 + index))
    deleted, left = delete_past_budget(store, "kv/ns/", 250, {"kv/ns/a": 5000.0})
    assert (deleted, left) == (2, 200)
    assert sorted(info.key for info in store.list("kv/")) == ["kv/ns/a", "kv/ns/d"]
    assert delete_past_budget(store, "kv/ns/", 250, {}) == (0, 200)


WRITER_SCRIPT = """
import json, sys
from bulkinfer.engine import LLM, SamplingParams
from bulkinfer.engine.kv_connector import LocalFolderBlobStore
store_dir, copy_dir, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
llm = LLM(copy_dir, dtype="float32", num_kv_blocks=64, kv_populate_seconds=0,
          kv_store=LocalFolderBlobStore(store_dir), kv_store_min_tokens=0)
outputs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0))
llm.engine.shutdown()  # its saves are written first
print(json.dumps([output.outputs[0].token_ids for output in outputs]))
"""


def test_a_second_process_loads_what_the_first_computed_from_another_folder(tiny_checkpoint, tmp_path,
                                                                             computed) -> None:
    """Two workers: one computes and saves (from its own copy of the model), the other loads."""
    copy = tmp_path / "model-copy"
    shutil.copytree(tiny_checkpoint, copy)
    store_dir = tmp_path / "store"
    command = [sys.executable, "-c", WRITER_SCRIPT, str(store_dir), str(copy), json.dumps(PROMPTS)]
    result = subprocess.run(command, capture_output=True, text=True, check=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert json.loads(result.stdout.strip().splitlines()[-1]) == computed["float32"]
    reader = engine(tiny_checkpoint, LocalFolderBlobStore(store_dir))
    assert generate(reader) == computed["float32"]
    assert reader.engine.kv_store_stats()["hits_blocks"] == len(PREFIX) // BLOCK


def test_async_scheduling_saves_and_loads_the_blocks_the_synchronous_loop_does(tiny_checkpoint, tmp_path,
                                                                                computed) -> None:
    """With async scheduling a block can count as computed while the step writing it still runs: its
    copy to the store waits for that step (the step thread makes it), so what is saved, and what a
    second engine loads from it, gives the tokens computed without a store."""
    store = LocalFolderBlobStore(tmp_path)
    assert fill(tiny_checkpoint, store, async_scheduling=True) == computed["float32"]
    assert len(block_files(tmp_path)) == len(PREFIX) // BLOCK
    reader = engine(tiny_checkpoint, store, async_scheduling=True)
    assert generate(reader) == computed["float32"]
    assert reader.engine.kv_store_stats()["hits_blocks"] == len(PREFIX) // BLOCK
