"""dtype="auto": the hardware and the checkpoint choose; every choice says why; KV sized from it.

On a CPU the flags decide where they settle it (AVX2-only or AVX-512 without bf16: fp32; AMX with
its tile state granted: bf16), else a verdict measured once and kept beside the model cache: never a
timing taken at start-up, which met whatever load the machine had and made two starts of one
machine choose differently (issue 55, item 9)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from bulkinfer.cpu_isa import read_cpu_flags
from bulkinfer.engine import LLM, EngineConfig, dtype_choice, dtype_verdict
from bulkinfer.engine.attention import TorchPagedAttention
from bulkinfer.engine.dtype_choice import (
    checkpoint_dtype,
    cpu_auto_dtype,
    cpu_flags,
    resolve_dtype,
)
from bulkinfer.engine.dtype_verdict import (
    DEFAULT_VERDICTS_FILE,
    VERDICTS_ENV,
    Bf16Verdict,
    kept_verdict,
    read_verdict,
    verdict_key,
    verdicts_file,
)
from bulkinfer.engine.model_runner import ModelRunner
from bulkinfer.engine.models import load_model

FAST = Bf16Verdict("bfloat16", 1.45, 1.9, 1.1, "2026-05-01T10:00Z", 5, 0.04, "reference")
SLOW = Bf16Verdict("float32", 0.93, 1.2, 0.8, "2026-05-02T11:30Z", 5, 0.02, "reference")
# /proc/cpuinfo of each CPU kind (flags lines as Linux writes them)
CPUINFO = {
    "avx2": "fpu sse sse2 avx fma avx2",
    "avx512": "fpu sse avx fma avx2 avx512f avx512dq avx512bw avx512vl avx512_vnni",
    "avx512_bf16": "fpu sse avx fma avx2 avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16",
    "amx": "fpu avx fma avx2 avx512f avx512dq avx512bw avx512vl avx512_bf16 avx512_fp16 amx_bf16 amx_tile "
           "amx_int8",
}


def _flags(tmp_path: Path, kind: str) -> set[str]:
    cpuinfo = tmp_path / f"cpuinfo-{kind}"
    cpuinfo.write_text(f"processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: {CPUINFO[kind]}\n")
    return read_cpu_flags(cpuinfo)


def _never_measured() -> tuple[Bf16Verdict, bool]:
    raise AssertionError("the flags settle it: no verdict may be read or measured")


def _no_amx_state() -> bool:
    return False


def _amx_state() -> bool:
    return True


def test_the_flags_decide_where_they_settle_it(tmp_path: Path) -> None:
    for kind in ("avx2", "avx512"):  # no bf16 units at all: bf16 would be emulated
        choice = cpu_auto_dtype(_flags(tmp_path, kind), _never_measured, amx_granted=_amx_state)
        assert choice.dtype == "float32"
        assert choice.reason.startswith("auto: CPU flags: no AMX and no AVX512-BF16"), choice.reason
    amx = cpu_auto_dtype(_flags(tmp_path, "amx"), _never_measured, amx_granted=_amx_state)
    assert amx.dtype == "bfloat16" and "AMX (amx_bf16), its tile state granted" in amx.reason
    # AMX in the flags, the tile state refused by Linux (a hypervisor, an old kernel): the
    # avx512_bf16 case, decided by the kept verdict, which the reason quotes with its figures.
    refused = cpu_auto_dtype(_flags(tmp_path, "amx"), lambda: (SLOW, False), amx_granted=_no_amx_state)
    assert refused.dtype == "float32"
    assert "Linux does not grant AMX's tile state" in refused.reason and "0.93x" in refused.reason
    no_dot = _flags(tmp_path, "amx") - {"avx512_bf16"}
    assert cpu_auto_dtype(no_dot, _never_measured, amx_granted=_no_amx_state).dtype == "float32"


def test_avx512_bf16_without_amx_takes_the_kept_verdict_and_says_so(tmp_path: Path) -> None:
    flags = _flags(tmp_path, "avx512_bf16")
    fast = cpu_auto_dtype(flags, lambda: (FAST, False), amx_granted=_never_measured)
    assert fast.dtype == "bfloat16"
    for figure in ("the verdict kept for this CPU", "bf16 1.45x fp32", "decode 1.90x", "prefill 1.10x",
                   "measured 2026-05-01T10:00Z", "4% busy"):
        assert figure in fast.reason, fast.reason
    slow = cpu_auto_dtype(flags, lambda: (SLOW, True), amx_granted=_never_measured)
    assert slow.dtype == "float32" and "measured now on this CPU and kept" in slow.reason
    capped = cpu_auto_dtype(flags, lambda: (FAST, False), cap_note="CPU capped at avx512_bf16")
    assert capped.reason.startswith("auto: CPU flags (CPU capped at avx512_bf16): avx512_bf16")


@pytest.fixture
def fresh_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """As in a new process: nothing measured here yet."""
    monkeypatch.setattr(dtype_verdict, "_measured_here", set())


def test_a_verdict_is_measured_once_then_every_process_reads_it(tmp_path: Path, fresh_process: None,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "cache" / "cpu-dtype-verdicts.json"
    key = verdict_key("AMD EPYC 9R14", _flags(tmp_path, "avx512_bf16"), "2.13.0")
    measured: list[int] = []

    def measure() -> Bf16Verdict:
        measured.append(1)
        return FAST

    assert kept_verdict(path, key, measure) == (FAST, True)
    assert read_verdict(path, key) == FAST and len(measured) == 1
    monkeypatch.setattr(dtype_verdict, "_measured_here", set())  # a second process starts

    def never() -> Bf16Verdict:
        raise AssertionError("a kept verdict is never timed again")

    assert kept_verdict(path, key, never) == (FAST, False)
    # another CPU (or torch) sharing the model cache gets its own verdict, beside the first
    other = verdict_key("Intel Xeon 8488C", _flags(tmp_path, "amx"), "2.13.0")
    assert kept_verdict(path, other, lambda: SLOW) == (SLOW, True)
    assert read_verdict(path, key) == FAST and read_verdict(path, other) == SLOW
    assert "AMD EPYC 9R14" in key and "avx512_bf16" in key and "torch 2.13.0" in key
    assert "amx_tile" in other and "amx_tile" not in key


def test_remeasure_measures_again_once_and_replaces_the_kept_verdict(tmp_path: Path, fresh_process: None,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    path, key = tmp_path / "verdicts.json", "cpu"
    assert kept_verdict(path, key, lambda: FAST) == (FAST, True)
    monkeypatch.setattr(dtype_verdict, "_measured_here", set())  # later, a process with remeasure_dtype
    measured: list[int] = []

    def measure() -> Bf16Verdict:
        measured.append(1)
        return SLOW

    assert kept_verdict(path, key, measure, remeasure=True) == (SLOW, True)
    assert read_verdict(path, key) == SLOW
    # A second engine of the same process (a worker serving two models) does not measure a third time.
    assert kept_verdict(path, key, measure, remeasure=True) == (SLOW, False)
    assert len(measured) == 1


def test_an_unreadable_verdict_file_is_measured_again(tmp_path: Path, fresh_process: None) -> None:
    path = tmp_path / "verdicts.json"
    path.write_text("{not json")
    assert kept_verdict(path, "cpu", lambda: FAST) == (FAST, True)
    assert json.loads(path.read_text())["verdicts"]["cpu"]["dtype"] == "bfloat16"
    path.write_text(json.dumps({"format": 1, "verdicts": {"cpu": {"dtype": "bfloat16"}}}))  # fields missing
    assert read_verdict(path, "cpu") is None


def test_the_engine_reads_its_verdict_file_from_the_config(tmp_path: Path, fresh_process: None,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """resolve_dtype's own CPU path, on a CPU shown as AVX512-BF16 without AMX: the verdict file the
    engine is given (a worker's: beside its model cache) is where it is measured once and read after."""
    monkeypatch.setattr(dtype_choice, "cpu_flags", lambda: _flags(tmp_path, "avx512_bf16"))
    measured: list[int] = []

    def measure() -> Bf16Verdict:
        measured.append(1)
        return FAST

    monkeypatch.setattr("bulkinfer.engine.dtype_benchmark.measure_bf16_verdict", measure)
    monkeypatch.delenv(VERDICTS_ENV)
    configured = tmp_path / "models" / "cpu-dtype-verdicts.json"
    first = resolve_dtype("auto", "cpu", None, verdicts=str(configured))
    monkeypatch.setattr(dtype_verdict, "_measured_here", set())
    again = resolve_dtype("auto", "cpu", None, verdicts=str(configured))
    assert first.dtype == again.dtype == "bfloat16" and len(measured) == 1 and configured.is_file()
    assert "measured now" in first.reason and "kept for this CPU" in again.reason
    resolve_dtype("auto", "cpu", None, verdicts=str(configured), remeasure=True)
    assert len(measured) == 2


def test_tests_never_read_a_kept_verdict_from_the_real_cache() -> None:
    """tests/conftest.py points the verdicts at this session's own temporary file, over whatever an
    engine or worker is configured with."""
    for configured in (None, str(DEFAULT_VERDICTS_FILE), "~/.cache/bulkinfer/models/cpu-dtype-verdicts.json"):
        path = verdicts_file(configured)
        assert path != DEFAULT_VERDICTS_FILE and "bulkinfer-test-dtype-verdicts-" in str(path)
    from bulkinfer.jobs.settings import DEFAULT_MODEL_CACHE

    assert DEFAULT_VERDICTS_FILE.parent == DEFAULT_MODEL_CACHE  # the engine alone keeps it there too


def test_cuda_auto_takes_the_checkpoint_dtype():
    assert resolve_dtype("auto", "cuda", "bfloat16", cuda_bf16=lambda: True).dtype == "bfloat16"
    assert resolve_dtype("auto", "cuda", "float16", cuda_bf16=lambda: True).dtype == "float16"
    assert resolve_dtype("auto", "cuda", "float32", cuda_bf16=lambda: True).dtype == "float32"
    assert resolve_dtype("auto", "cuda", None, cuda_bf16=lambda: True).dtype == "float32"
    old_gpu = resolve_dtype("auto", "cuda:0", "bfloat16", cuda_bf16=lambda: False)
    assert old_gpu.dtype == "float16" and "no bf16" in old_gpu.reason


def test_an_explicit_dtype_is_kept_and_a_bad_one_is_named():
    choice = resolve_dtype("float16", "cpu", "bfloat16", cpu=_never_measured)
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


def test_cpu_flags_are_read_from_cpuinfo(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 fma\n")
    assert {"avx2", "fma"} <= cpu_flags(cpuinfo)
    assert cpu_flags(tmp_path / "absent") == set()


def test_engine_logs_and_exposes_its_choice(tiny_checkpoint, caplog):
    with caplog.at_level(logging.INFO, logger="bulkinfer.engine.llm_engine"):
        llm = LLM(model=str(tiny_checkpoint), num_kv_blocks=16)
    choice = llm.dtype_choice
    assert choice.reason.startswith("auto: CPU flags")
    assert choice == resolve_dtype("auto", "cpu", None)  # the same rule, the same answer, every start
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
