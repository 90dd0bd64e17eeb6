"""The CPU KV cache reads as zeros and takes memory as blocks are used, or at start when populated."""

from __future__ import annotations

from pathlib import Path

import torch

from bulkinfer.engine import EngineConfig
from bulkinfer.engine.attention import TorchPagedAttention
from bulkinfer.engine.host_memory import read_proc_kib
from bulkinfer.engine.kv_memory import populate_kv_caches, zeroed_kv_cache
from bulkinfer.engine.model_runner import PROFILE_LAYERS, ModelRunner
from bulkinfer.engine.models import load_model


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


def two_layer_cache(blocks: int) -> list[torch.Tensor]:
    """Two layers of `blocks` blocks: 8 KiB of keys and 8 KiB of values a block a layer."""
    return [zeroed_kv_cache((2, blocks, 4, 16, 64), torch.bfloat16, torch.device("cpu")) for _ in range(2)]


def test_populating_maps_every_block_of_every_layer_up_front_and_keeps_them_zero() -> None:
    caches = two_layer_cache(2048)  # 64 MiB
    before = resident_kib()
    assert populate_kv_caches(caches, seconds=60.0, threads=2) == 2048
    assert resident_kib() - before > 60 * 1024
    assert all(torch.count_nonzero(cache) == 0 for cache in caches)
    written = resident_kib()
    caches[1][1, :2048] = 2.0  # a job's writes now map nothing new
    assert resident_kib() - written < 1024


def test_no_time_for_populating_leaves_the_cache_to_be_mapped_on_first_use() -> None:
    caches = two_layer_cache(2048)
    before = resident_kib()
    assert populate_kv_caches(caches, seconds=0.0) == 0
    assert resident_kib() - before < 4 * 1024


def test_engine_start_profiles_two_layers_then_maps_the_cache_it_sized(tiny_checkpoint) -> None:
    model = load_model(tiny_checkpoint, TorchPagedAttention(), dtype=torch.float32)
    calls = [0] * len(model.layers)
    for index, layer in enumerate(model.layers):
        layer.register_forward_hook(lambda *_, index=index: calls.__setitem__(index, calls[index] + 1))
    runner = ModelRunner(EngineConfig(model=str(tiny_checkpoint), dtype="float32", max_model_len=512,
                                      kv_cache_memory=48 << 20), model)
    before = resident_kib()
    blocks = runner.initialize_kv_cache()
    assert len(model.layers) > PROFILE_LAYERS
    assert calls == [1] * PROFILE_LAYERS + [0] * (len(model.layers) - PROFILE_LAYERS)
    assert blocks * runner.kv_block_bytes > 40 << 20
    assert resident_kib() - before > blocks * runner.kv_block_bytes // 1024 * 0.9  # mapped up front


def test_memory_the_process_held_and_freed_before_does_not_shrink_the_kv_budget(tiny_checkpoint) -> None:
    """The budget subtracts the profiling pass's peak RSS growth; an earlier peak (an engine built
    and dropped before, its cache mapped at start) must not count as that pass's activations."""
    spike = torch.ones(2 << 28)  # 2 GiB written, then freed
    del spike
    model = load_model(tiny_checkpoint, TorchPagedAttention(), dtype=torch.float32)
    runner = ModelRunner(EngineConfig(model=str(tiny_checkpoint), dtype="float32", max_model_len=512,
                                      max_num_seqs=8192, kv_cache_memory=0.25, kv_populate_seconds=0),
                         model)
    expected = read_proc_kib(Path("/proc/meminfo"), "MemAvailable") * 1024 // 4
    runner.initialize_kv_cache()
    assert runner.num_kv_blocks < runner.max_useful_blocks()  # the budget decided, not the cap
    assert runner.num_kv_blocks * runner.kv_block_bytes > expected - (512 << 20)
