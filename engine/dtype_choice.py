"""`dtype="auto"`: the compute dtype that serves a checkpoint best on this device.

- CUDA: the checkpoint's own dtype (``torch_dtype``/``dtype`` in config.json); fp32 checkpoints
  stay fp32, and bf16 falls back to fp16 on a GPU without bf16.
- CPU: bf16 when the CPU multiplies bf16 natively (AMX or AVX512-BF16 in its flags) *and* a short
  timed probe at start-up confirms bf16 matmul beats fp32; fp32 otherwise. On AVX2-only CPUs bf16
  matmul is emulated and ~70x slower than fp32, on AMX CPUs 4-7x faster: the flag alone can lie
  (a hypervisor may hide AMX state), the probe settles it.

The choice and its reason are logged by the engine and recorded in each job's manifest.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_CHOICES = ("auto", *DTYPES)
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
# bf16 must beat fp32 by this much in the probe to be chosen (noise on a shared machine).
PROBE_MIN_SPEEDUP = 1.2


@dataclass(frozen=True)
class CpuBf16Probe:
    """What the CPU says it can do, and what a timed matmul showed."""

    flags: tuple[str, ...]  # the native-bf16 flags found in /proc/cpuinfo
    fp32_gflops: float
    bf16_gflops: float

    @property
    def speedup(self) -> float:
        return self.bf16_gflops / self.fp32_gflops if self.fp32_gflops else 0.0

    @property
    def native_bf16(self) -> bool:
        return bool(self.flags) and self.speedup >= PROBE_MIN_SPEEDUP

    def describe(self) -> str:
        flags = ", ".join(self.flags) if self.flags else "no amx_bf16/avx512_bf16 flag"
        return f"{flags}; probe bf16 {self.bf16_gflops:.0f} vs fp32 {self.fp32_gflops:.0f} GFLOP/s"


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str  # one of DTYPES
    reason: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The CPU's feature flags (Linux); empty where /proc/cpuinfo is absent."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_model_name(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name (Linux); the machine type where /proc/cpuinfo is absent."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return os.uname().machine


PROBE_ROUNDS = 3
# A CPU claiming native bf16 whose probe does not show it is measured again, a moment later.
PROBE_ATTEMPTS = 4
PROBE_RETRY_PAUSE_S = 0.5


class _MatmulProbe:
    """A decoder projection over a prefill chunk, through the kernel the model's projections use
    (oneDNN with a packed weight where available): big enough to reach the kernel's steady state,
    small enough that a round costs ~25 ms."""

    def __init__(self, dtype: torch.dtype) -> None:
        from bulkinfer.engine.models.llama import Linear, onednn_linear_available

        self.layer = Linear(1024, 1024, bias=False).to(dtype).requires_grad_(False)
        if onednn_linear_available(torch.device("cpu"), dtype):
            self.layer.pack_for_onednn(256)
        self.input = torch.randn(256, 1024).to(dtype)
        with torch.inference_mode():
            self.layer(self.input)  # first calls: kernel selection, thread and AMX state set-up
            self.layer(self.input)

    def gflops(self, seconds: float) -> float:
        with torch.inference_mode():
            runs, started = 0, time.perf_counter()
            while (elapsed := time.perf_counter() - started) < seconds or runs < 3:
                self.layer(self.input)
                runs += 1
        return 2 * 256 * 1024 * 1024 * runs / elapsed / 1e9


def _matmul_gflops(dtypes: tuple[torch.dtype, ...], seconds: float = 0.025) -> list[float]:
    """Each dtype's best GFLOP/s over a few rounds taken in turn: the engine loads its tokenizer and
    weights on other threads meanwhile, and alternating rounds meet the same contention."""
    probes = [_MatmulProbe(dtype) for dtype in dtypes]
    best = [0.0] * len(dtypes)
    for _ in range(PROBE_ROUNDS):
        for i, probe in enumerate(probes):
            best[i] = max(best[i], probe.gflops(seconds))
    return best


@functools.cache
def probe_cpu_bf16() -> CpuBf16Probe:
    """Read the flags and time bf16 vs fp32 matmul once per process."""
    flags = tuple(f for f in NATIVE_BF16_FLAGS if f in cpu_flags())
    if not flags:  # emulated bf16 is slow for sure: skip the (then very slow) bf16 probe
        return CpuBf16Probe(flags, _matmul_gflops((torch.float32,))[0], 0.0)
    return confirm_bf16(flags, lambda: _matmul_gflops((torch.float32, torch.bfloat16)))


def confirm_bf16(flags: tuple[str, ...], measure: Callable[[], list[float]],
                 sleep: Callable[[float], None] = time.sleep) -> CpuBf16Probe:
    """The probe of a CPU whose flags claim native bf16: (fp32, bf16) GFLOP/s from `measure()`,
    measured again (up to PROBE_ATTEMPTS, PROBE_RETRY_PAUSE_S apart) while bf16 does not yet show
    its speedup, keeping each dtype's best. Another process starting beside the engine (a worker's
    neighbour importing torch) once made bf16 read 67 vs fp32 77 GFLOP/s on a CPU where it runs at
    twice fp32, and the engine then kept fp32 for its life. A CPU whose bf16 is really emulated never
    reaches the speedup, and costs only the extra attempts."""
    fp32, bf16 = measure()
    for _ in range(PROBE_ATTEMPTS - 1):
        if fp32 and bf16 / fp32 >= PROBE_MIN_SPEEDUP:
            break
        sleep(PROBE_RETRY_PAUSE_S)
        again = measure()
        fp32, bf16 = max(fp32, again[0]), max(bf16, again[1])
    return CpuBf16Probe(flags, fp32, bf16)


def checkpoint_dtype(model_dir: str | Path) -> str | None:
    """The dtype a checkpoint's config.json declares (``dtype`` in transformers 5, ``torch_dtype``
    before), as one of DTYPES; None when absent or not one of ours."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = config.get("dtype") or config.get("torch_dtype")
    return value if value in DTYPES else None


def resolve_dtype(
    requested: str,
    device: str,
    checkpoint: str | None,
    probe: Callable[[], CpuBf16Probe] = probe_cpu_bf16,
    cuda_bf16: Callable[[], bool] | None = None,
) -> DtypeChoice:
    """The dtype to run in and why. ``requested`` is ``auto`` or one of DTYPES."""
    if requested not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {DTYPE_CHOICES}, got {requested!r}")
    if requested != "auto":
        return DtypeChoice(requested, f"{requested} requested")
    if torch.device(device).type == "cuda":
        declared = checkpoint or "float32"
        if declared == "bfloat16" and not (cuda_bf16 or torch.cuda.is_bf16_supported)():
            return DtypeChoice("float16", "auto: checkpoint is bfloat16 but this GPU has no bf16; float16")
        return DtypeChoice(declared, f"auto: the checkpoint's dtype on CUDA ({checkpoint or 'not declared'})")
    if torch.device(device).type != "cpu":
        return DtypeChoice("float32", f"auto: float32 on {device}")
    found = probe()
    if found.native_bf16:
        return DtypeChoice("bfloat16", f"auto: CPU has native bf16 ({found.describe()})")
    return DtypeChoice("float32", f"auto: CPU without fast bf16 ({found.describe()})")
