"""What this CPU can do, as the engine's CPU-kind choices read it: /proc/cpuinfo's flags under the
project's ISA cap (`BULKINFER_CPU_ISA`, bulkinfer/cpu_isa.py), its model name, and whether Linux
grants AMX's tile state to this process."""

from __future__ import annotations

import ctypes
import os
import platform
import sys
from collections.abc import Collection
from pathlib import Path

from bulkinfer.cpu_isa import CPUINFO, active_cap, masked_flags, read_cpu_flags

AMX_FLAGS = frozenset({"amx_tile", "amx_bf16"})
DOT_BF16_FLAG = "avx512_bf16"  # AVX-512's bf16 dot product (vdpbf16ps)
# Linux x86-64: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), what the native kernels and
# oneDNN ask before their first AMX instruction (engine/cpu_kernels/row_gemm.c).
_SYS_ARCH_PRCTL = 158
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


def cpu_flags(cpuinfo: Path = CPUINFO) -> set[str]:
    """The CPU's feature flags without those above the ISA cap; empty where /proc/cpuinfo is absent."""
    return masked_flags(read_cpu_flags(cpuinfo), active_cap())


def cpu_model_name(cpuinfo: Path = CPUINFO) -> str:
    """The CPU's model name (Linux); the machine type where /proc/cpuinfo is absent."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return os.uname().machine


def has_amx(flags: Collection[str]) -> bool:
    return AMX_FLAGS <= set(flags)


def native_bf16_products(flags: Collection[str] | None = None) -> bool:
    """Whether the flags claim bf16 products in hardware (AMX or AVX512-BF16); without either, bf16
    matmul is emulated, tens of times slower than fp32."""
    flags = cpu_flags() if flags is None else flags
    return has_amx(flags) or DOT_BF16_FLAG in flags


def amx_tile_state_granted() -> bool:
    """Whether Linux lets this process use AMX's tiles (it may not: an old kernel, or a hypervisor
    that shows the flags without the state). Asking is harmless and is what every AMX user does."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        arguments = (ctypes.c_long(_SYS_ARCH_PRCTL), ctypes.c_long(_ARCH_REQ_XCOMP_PERM),
                     ctypes.c_long(_XFEATURE_XTILEDATA))
        return libc.syscall(*arguments) == 0
    except (OSError, AttributeError):
        return False
