"""The project-level CPU ISA cap (`BULKINFER_CPU_ISA`, bulkinfer/cpu_isa.py): under it every choice
that depends on the CPU's kind is made as on the smaller kind. The mappings are checked as units
for every kind (a machine cannot be capped below what it has, nor above), and a capped process end
to end at avx2, which every machine this project runs on has or exceeds."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bulkinfer.cpu_isa import (
    ATEN_ENV,
    CAP_ENV,
    ONEDNN_ENV,
    apply_cpu_isa_cap,
    compiler_flags,
    describe_cap,
    effective_cap,
    machine_kind,
    masked_flags,
    read_cpu_flags,
    torch_environment,
)
from bulkinfer.engine import cpu_kernels
from bulkinfer.jobs.settings import ConfigError, Settings
from tests.fixtures.services import REPO_ROOT

AVX2 = {"sse", "avx", "avx2", "fma"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}
ZEN4 = AVX512 | {"avx512_bf16"}
SAPPHIRE_RAPIDS = ZEN4 | {"avx512_fp16", "amx_tile", "amx_bf16", "amx_int8"}


def test_each_machine_is_the_largest_kind_it_has_every_flag_of() -> None:
    assert [machine_kind(flags) for flags in (AVX2, AVX512, ZEN4, SAPPHIRE_RAPIDS)] == [
        "avx2", "avx512", "avx512_bf16", "amx"]
    assert machine_kind({"sse", "avx"}) is None  # below every kind (or not x86)
    assert machine_kind(AVX2 | {"avx512f", "avx512_bf16"}) == "avx2"  # no AVX-512 core set: not avx512


def test_a_cap_changes_something_only_below_the_machines_own_kind() -> None:
    assert effective_cap("avx2", "amx") == "avx2"
    assert effective_cap("avx512_bf16", "amx") == "avx512_bf16"
    assert effective_cap("amx", "avx2") is None  # above the machine: its own
    assert effective_cap("avx2", "avx2") is None
    assert effective_cap(None, "amx") is None and effective_cap("avx2", None) is None


def test_the_flags_above_a_cap_are_masked() -> None:
    assert masked_flags(SAPPHIRE_RAPIDS, "avx2") == AVX2
    assert masked_flags(SAPPHIRE_RAPIDS, "avx512") == AVX512
    assert masked_flags(SAPPHIRE_RAPIDS, "avx512_bf16") == ZEN4
    assert masked_flags(SAPPHIRE_RAPIDS, "amx") == SAPPHIRE_RAPIDS == masked_flags(SAPPHIRE_RAPIDS, None)


def test_oneDNN_and_ATen_are_capped_with_their_own_names() -> None:  # noqa: N802 - the libraries' names
    assert torch_environment("avx2") == {ONEDNN_ENV: "AVX2", ATEN_ENV: "avx2"}
    # ATen's vector code knows no kind above AVX-512 (and takes "avx512" on trust: never set up)
    assert torch_environment("avx512") == {ONEDNN_ENV: "AVX512_CORE"}
    assert torch_environment("avx512_bf16") == {ONEDNN_ENV: "AVX512_CORE_BF16"}
    assert torch_environment("amx") == {ONEDNN_ENV: "AVX512_CORE_AMX"}
    assert torch_environment(None) == {}


def test_applying_a_cap_sets_the_variables_and_keeps_the_users_own() -> None:
    environ = {CAP_ENV: "avx2"}
    assert apply_cpu_isa_cap(environ=environ, flags=SAPPHIRE_RAPIDS) == "avx2"
    assert environ == {CAP_ENV: "avx2", ONEDNN_ENV: "AVX2", ATEN_ENV: "avx2"}
    # a flag then gives another cap (flags over variables): this process's own values follow it
    assert apply_cpu_isa_cap("avx512_bf16", environ=environ, flags=SAPPHIRE_RAPIDS) == "avx512_bf16"
    assert environ == {CAP_ENV: "avx512_bf16", ONEDNN_ENV: "AVX512_CORE_BF16"}
    users = {ONEDNN_ENV: "AVX512_CORE", ATEN_ENV: "default"}
    assert apply_cpu_isa_cap("avx2", environ=users, flags=SAPPHIRE_RAPIDS) == "avx2"
    assert users == {CAP_ENV: "avx2", ONEDNN_ENV: "AVX512_CORE", ATEN_ENV: "default"}
    above = {}
    assert apply_cpu_isa_cap("amx", environ=above, flags=AVX2) is None  # the machine's own: no cap
    assert above == {CAP_ENV: "amx"}
    assert apply_cpu_isa_cap(environ={}, flags=SAPPHIRE_RAPIDS) is None
    with pytest.raises(ValueError, match="BULKINFER_CPU_ISA must be one of avx2, avx512, avx512_bf16, amx"):
        apply_cpu_isa_cap("avx512f", environ={}, flags=AVX2)


def test_the_log_says_what_a_cap_does_here() -> None:
    assert describe_cap({CAP_ENV: "avx2"}, SAPPHIRE_RAPIDS) == (
        "CPU capped at avx2 by BULKINFER_CPU_ISA (this CPU: amx)")
    assert describe_cap({CAP_ENV: "amx"}, AVX2) == (
        "BULKINFER_CPU_ISA=amx is not below this CPU's own kind (avx2): no cap")
    assert "ignored" in describe_cap({CAP_ENV: "sse"}, AVX2)
    assert describe_cap({}, AVX2) is None


@pytest.mark.parametrize(("cap", "defined", "undefined"), [
    ("avx2", ["__AVX2__", "__FMA__"], ["__AVX512F__", "__AVX512BF16__", "__AMX_TILE__", "__AMX_BF16__"]),
    ("avx512", ["__AVX512F__", "__AVX512BW__", "__AVX512VL__", "__AVX512DQ__"],
     ["__AVX512BF16__", "__AMX_TILE__", "__AMX_BF16__"]),
    ("avx512_bf16", ["__AVX512F__", "__AVX512BF16__"], ["__AMX_TILE__", "__AMX_BF16__"]),
    ("amx", ["__AVX512BF16__", "__AMX_TILE__", "__AMX_BF16__"], []),
])
def test_the_kernels_compile_flags_select_the_capped_kinds_code(cap: str, defined: list[str],
                                                               undefined: list[str]) -> None:
    """The macros the kernels' `#if` paths test (engine/cpu_kernels/*.c, simd.h), for a compiler
    targeting an AMX CPU (what -march=native gives there) with the cap's flags added."""
    compiler = cpu_kernels._compiler()
    if compiler is None:
        pytest.skip("no C compiler")
    result = subprocess.run([compiler, "-march=sapphirerapids", *compiler_flags(cap), "-dM", "-E", "-x", "c",
                             os.devnull], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"{compiler} does not know -march=sapphirerapids: {result.stderr.strip()[:200]}")
    macros = {line.split()[1] for line in result.stdout.splitlines() if line.startswith("#define")}
    assert set(defined) <= macros and not set(undefined) & macros


CAPPED_PROCESS = """
import json, os, bulkinfer, torch
from bulkinfer.engine import cpu_kernels
from bulkinfer.engine.cpu_features import cpu_flags
from bulkinfer.engine.dtype_choice import resolve_dtype
kernels = cpu_kernels.load()
choice = resolve_dtype("auto", "cpu", None)
print(json.dumps({"dtype": choice.dtype, "reason": choice.reason,
                  "flags": sorted(f for f in cpu_flags() if f.startswith(("avx512", "amx"))),
                  "lanes": kernels and kernels.vector_lanes,
                  "row_bf16": kernels and kernels.row_gemm_bf16_kind,
                  "prefix": kernels and kernels.prefix_kind, "aten": torch.backends.cpu.get_cpu_capability(),
                  "onednn": os.environ.get("ONEDNN_MAX_CPU_ISA")}))
"""


def test_a_process_capped_at_avx2_runs_as_an_avx2_machine() -> None:
    env = {**os.environ, CAP_ENV: "avx2"}
    env.pop(ONEDNN_ENV, None)
    env.pop(ATEN_ENV, None)
    result = subprocess.run([sys.executable, "-c", CAPPED_PROCESS], cwd=REPO_ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["dtype"] == "float32" and seen["reason"].startswith("auto: CPU flags"), seen["reason"]
    assert seen["flags"] == []
    assert seen["aten"] == "AVX2"
    if seen["lanes"] is not None:  # the kernels built (a compiler is there)
        assert (seen["lanes"], seen["row_bf16"], seen["prefix"]) == (8, None, None)
    above_avx2 = machine_kind(read_cpu_flags()) not in ("avx2", None)
    assert seen["onednn"] == ("AVX2" if above_avx2 else None)  # set only where it caps something


def test_cpu_isa_is_a_setting_like_every_other() -> None:
    assert Settings.from_env({"BULKINFER_CPU_ISA": "avx512_bf16"}).cpu_isa == "avx512_bf16"
    assert Settings.from_env({"BULKINFER_CPU_ISA": "avx2"}, cpu_isa="amx").cpu_isa == "amx"  # a flag wins
    assert Settings(cpu_isa="avx2").to_env()["BULKINFER_CPU_ISA"] == "avx2"  # a worker child gets it
    with pytest.raises(ConfigError, match="environment variable BULKINFER_CPU_ISA"):
        Settings.from_env({"BULKINFER_CPU_ISA": "avx512f"})
