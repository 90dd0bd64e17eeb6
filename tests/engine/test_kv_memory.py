"""The CPU KV cache reads as zeros and takes memory only as blocks are used."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.kv_memory import zeroed_kv_cache


def resident_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS in /proc/self/status")


def test_a_cpu_kv_cache_is_zeros_and_is_mapped_as_it_is_written() -> None:
    before = resident_kib()
    cache = zeroed_kv_cache((2, 4096, 4, 16, 64), torch.bfloat16, torch.device("cpu"))  # 128 MiB
    allocated = resident_kib()
    assert cache.shape == (2, 4096, 4, 16, 64) and cache.dtype == torch.bfloat16
    assert allocated - before < 16 * 1024  # not written up front
    cache[0, :512] = 1.5  # a job's first 512 blocks of keys: 4 MiB
    written = resident_kib()
    assert 3 * 1024 < written - allocated < 12 * 1024
    assert torch.count_nonzero(cache[0, 512:]) == 0 and torch.count_nonzero(cache[1]) == 0
    assert torch.all(cache[0, :512] == 1.5)
