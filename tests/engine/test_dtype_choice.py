"""dtype="auto": the hardware and the checkpoint choose; every choice says why; KV sized from it."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from bulkinfer.engine import LLM, EngineConfig
from bulkinfer.engine.attention import TorchPagedAttention
from bulkinfer.engine.dtype_choice import (
    PROBE_ATTEMPTS,
    CpuBf16Probe,
    checkpoint_dtype,
    confirm_bf16,
    cpu_flags,
    probe_cpu_bf16,
    resolve_dtype,
)
from bulkinfer.engine.model_runner import ModelRunner
from bulkinfer.engine.models import load_model

AMX = CpuBf16Probe(("amx_bf16",), fp32_gflops=300.0, bf16_gflops=1500.0)
AVX2 = CpuBf16Probe((), fp32_gflops=120.0, bf16_gflops=0.0)
# A flag the hypervisor shows, but bf16 is not faster in practice: the probe wins.
FLAG_BUT_SLOW = CpuBf16Probe(("avx512_bf16",), fp32_gflops=200.0, bf16_gflops=190.0)


def test_cpu_auto_takes_bf16_only_where_the_cpu_has_it_and_the_probe_confirms():
    native = resolve_dtype("auto", "cpu", "float32", probe=lambda: AMX)
    assert native.dtype == "bfloat16" and "amx_bf16" in native.reason and "1500" in native.reason
    assert resolve_dtype("auto", "cpu", "bfloat16", probe=lambda: AVX2).dtype == "float32"
    slow = resolve_dtype("auto", "cpu", None, probe=lambda: FLAG_BUT_SLOW)
    assert slow.dtype == "float32" and "without fast bf16" in slow.reason


def test_a_probe_disturbed_at_start_is_measured_again_before_bf16_is_given_up() -> None:
    # What a worker saw while another process imported torch beside it, then the CPU's real speeds.
    readings = iter([[77.0, 67.0], [150.0, 160.0], [440.0, 800.0], [430.0, 790.0]])
    pauses: list[float] = []
    found = confirm_bf16(("avx512_bf16",), lambda: next(readings), sleep=pauses.append)
    assert found.native_bf16 and (found.fp32_gflops, found.bf16_gflops) == (440.0, 800.0)
    assert len(pauses) == 2  # stopped measuring once bf16 showed its speedup
    # Emulated bf16 behind a flag: every attempt slow, fp32 chosen after PROBE_ATTEMPTS.
    calls: list[int] = []

    def emulated() -> list[float]:
        calls.append(1)
        return [400.0, 6.0]

    assert not confirm_bf16(("avx512_bf16",), emulated, sleep=lambda _s: None).native_bf16
    assert len(calls) == PROBE_ATTEMPTS


def test_cuda_auto_takes_the_checkpoint_dtype():
    assert resolve_dtype("auto", "cuda", "bfloat16", cuda_bf16=lambda: True).dtype == "bfloat16"
    assert resolve_dtype("auto", "cuda", "float16", cuda_bf16=lambda: True).dtype == "float16"
    assert resolve_dtype("auto", "cuda", "float32", cuda_bf16=lambda: True).dtype == "float32"
    assert resolve_dtype("auto", "cuda", None, cuda_bf16=lambda: True).dtype == "float32"
    old_gpu = resolve_dtype("auto", "cuda:0", "bfloat16", cuda_bf16=lambda: False)
    assert old_gpu.dtype == "float16" and "no bf16" in old_gpu.reason


def test_an_explicit_dtype_is_kept_and_a_bad_one_is_named():
    choice = resolve_dtype("float16", "cpu", "bfloat16", probe=lambda: AMX)
    assert (choice.dtype, choice.reason) == ("float16", "float16 requested")
    with pytest.raises(ValueError, match="dtype must be one of .* got 'fp8'"):
        resolve_dtype("fp8", "cpu", None)
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineConfig(model="m", dtype="half").validate()
    assert EngineConfig(model="m").dtype == "auto"


def test_checkpoint_dtype_reads_either_config_key(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    assert checkpoint_dtype(tmp_path) == "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "float16", "torch_dtype": "float32"}))
    assert checkpoint_dtype(tmp_path) == "float16"
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "int8"}))
    assert checkpoint_dtype(tmp_path) is None
    assert checkpoint_dtype(tmp_path / "missing") is None


def test_cpu_flags_and_probe_on_this_machine(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16\n")
    assert {"avx2", "avx512_bf16"} <= cpu_flags(cpuinfo)
    assert cpu_flags(tmp_path / "absent") == set()
    probe = probe_cpu_bf16()
    assert probe.fp32_gflops > 0
    # Without a native flag the slow emulated bf16 is never timed, and never chosen.
    assert probe.flags or (probe.bf16_gflops == 0 and not probe.native_bf16)


def test_engine_logs_and_exposes_its_choice(tiny_checkpoint, caplog):
    with caplog.at_level(logging.INFO, logger="bulkinfer.engine.llm_engine"):
        llm = LLM(model=str(tiny_checkpoint), num_kv_blocks=16)
    choice = llm.dtype_choice
    assert choice.reason.startswith("auto: ")
    assert choice.dtype == ("bfloat16" if probe_cpu_bf16().native_bf16 else "float32")
    assert llm.engine.model.embed_tokens.weight.dtype == choice.torch_dtype
    assert llm.engine.runner.kv_caches[0].dtype == choice.torch_dtype
    assert f"dtype {choice.dtype} ({choice.reason})" in caplog.text


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_kv_holds_twice_the_blocks(tiny_checkpoint, dtype):
    budget = 4 << 20
    counts = {}
    for name in ("float32", dtype):
        config = EngineConfig(model=str(tiny_checkpoint), dtype=name, kv_cache_memory=budget,
                              max_model_len=2048)
        model = load_model(tiny_checkpoint, TorchPagedAttention(), dtype=getattr(torch, name))
        runner = ModelRunner(config, model)
        counts[name] = runner.initialize_kv_cache()
        assert runner.kv_caches[0].dtype == getattr(torch, name)
        assert counts[name] == budget // runner.kv_block_bytes
    assert counts[dtype] == 2 * counts["float32"]
