"""bf16 against fp32 on a reference workload: what `dtype="auto"` measures once per CPU whose flags
do not settle it (engine/dtype_verdict.py keeps the result).

The workload is what the engine spends its CPU time on: one decoder layer's projections (QKV, O,
gate+up, down) of a 1B-class model, at a decode shape (single-token rows, through the row kernel
where the engine uses it, else oneDNN) and a prefill shape (a chunk of rows, through oneDNN with a
packed weight), the engine's own `Linear` and kernels. It waits for the machine to be quiet (as far
as /proc/stat tells), then times both dtypes in alternating order over several rounds and takes
each one's median, so a neighbour's burst moves one round, not the verdict.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from statistics import median

import torch

from bulkinfer.engine.dtype_verdict import Bf16Verdict

# bf16 must beat fp32 by this much on the whole workload to be chosen: below it, a verdict taken on a
# noisy machine could go either way, and fp32 is exact where bf16 rounds.
MIN_SPEEDUP = 1.2
SHAPES = ("decode", "prefill")


@dataclass(frozen=True)
class ReferenceWorkload:
    """One decoder layer's projections (defaults: Qwen2.5-1.5B-like widths, 256-wide KV) at a
    decode and a prefill shape; `decode_passes` decode steps for each prefill chunk."""

    hidden: int = 1536
    intermediate: int = 4096
    kv_width: int = 256
    decode_rows: int = 16
    prefill_rows: int = 256
    decode_passes: int = 8
    rounds: int = 5

    def describe(self) -> str:
        return (f"layer {self.hidden}x{self.intermediate}, decode {self.decode_rows} rows "
                f"x{self.decode_passes}, prefill {self.prefill_rows} rows")

    def projections(self) -> list[tuple[int, int]]:
        """(in, out) of each projection."""
        return [(self.hidden, self.hidden + 2 * self.kv_width), (self.hidden, self.hidden),
                (self.hidden, 2 * self.intermediate), (self.intermediate, self.hidden)]


class _LayerProjections:
    """The workload's projections in one dtype, each as the engine runs it at each shape."""

    def __init__(self, workload: ReferenceWorkload, dtype: torch.dtype, weights: list[torch.Tensor]) -> None:
        from bulkinfer.engine import cpu_kernels
        from bulkinfer.engine.models.layers import Linear, onednn_linear_available

        kernels = cpu_kernels.load()
        onednn = onednn_linear_available(torch.device("cpu"), dtype)
        self.passes = {"decode": workload.decode_passes, "prefill": 1}
        self.layers: dict[str, list[tuple[Linear, torch.Tensor]]] = {shape: [] for shape in SHAPES}
        for weight in weights:
            out_features, in_features = weight.shape
            for shape, rows in (("decode", workload.decode_rows), ("prefill", workload.prefill_rows)):
                layer = Linear(in_features, out_features, bias=False, device="meta")
                layer.weight = torch.nn.Parameter(weight.to(dtype), requires_grad=False)
                if shape == "decode" and layer.use_row_gemm(kernels, None):
                    pass  # single-token rows through the row kernel, as the engine's decode
                elif onednn:
                    try:
                        layer.pack_for_onednn(rows)
                    except RuntimeError:  # oneDNN without this dtype's path here (bf16 below AVX-512)
                        pass
                self.layers[shape].append((layer, torch.randn(rows, in_features).to(dtype)))
        for shape in SHAPES:  # first calls: kernel selection, thread and AMX state set-up
            self.run(shape)

    def run(self, shape: str) -> float:
        """Seconds for this shape's passes over every projection."""
        with torch.inference_mode():
            started = time.perf_counter()
            for _ in range(self.passes[shape]):
                for layer, rows in self.layers[shape]:
                    layer(rows)
            return time.perf_counter() - started


Timer = Callable[[torch.dtype, str], float]  # seconds for one dtype's passes of one shape


def engine_timer(workload: ReferenceWorkload) -> Timer:
    """Times the workload through the engine's projections (both dtypes built from the same weights)."""
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(out, in_, generator=generator) * in_ ** -0.5
               for in_, out in workload.projections()]
    built = {dtype: _LayerProjections(workload, dtype, weights) for dtype in (torch.float32, torch.bfloat16)}
    return lambda dtype, shape: built[dtype].run(shape)


def timed_rounds(timer: Timer, rounds: int) -> dict[tuple[torch.dtype, str], float]:
    """Each (dtype, shape)'s median seconds over `rounds`, the dtypes taking turns to go first."""
    times: dict[tuple[torch.dtype, str], list[float]] = {}
    for round_index in range(rounds):
        order = (torch.float32, torch.bfloat16) if round_index % 2 == 0 else (torch.bfloat16, torch.float32)
        for dtype in order:
            for shape in SHAPES:
                times.setdefault((dtype, shape), []).append(timer(dtype, shape))
    return {key: median(values) for key, values in times.items()}


def verdict_from_times(medians: dict[tuple[torch.dtype, str], float], rounds: int, busy: float,
                       workload: str, now: datetime | None = None) -> Bf16Verdict:
    def total(dtype: torch.dtype) -> float:
        return sum(medians[(dtype, shape)] for shape in SHAPES)

    def ratio(shape: str) -> float:
        return medians[(torch.float32, shape)] / medians[(torch.bfloat16, shape)]

    speedup = total(torch.float32) / total(torch.bfloat16)
    when = (now or datetime.now(UTC)).strftime("%Y-%m-%dT%H:%MZ")
    return Bf16Verdict(dtype="bfloat16" if speedup >= MIN_SPEEDUP else "float32", speedup=round(speedup, 3),
                       decode_speedup=round(ratio("decode"), 3), prefill_speedup=round(ratio("prefill"), 3),
                       measured_at=when, rounds=rounds, busy=round(busy, 3), workload=workload)


def measure_bf16_verdict(workload: ReferenceWorkload | None = None, timer: Timer | None = None,
                         busy: Callable[[], float] | None = None) -> Bf16Verdict:
    """The verdict of this CPU: waits (a while) for a quiet machine, then times the workload."""
    workload = workload or ReferenceWorkload()
    timer = timer or engine_timer(workload)
    busy_share = (busy or wait_until_quiet)()
    medians = timed_rounds(timer, workload.rounds)
    return verdict_from_times(medians, workload.rounds, busy_share, workload.describe())


# A machine this busy or less counts as quiet; waited for at most QUIET_WAIT_S.
QUIET_BUSY_SHARE = 0.25
QUIET_WAIT_S = 10.0


def wait_until_quiet(sample_s: float = 0.25, wait_s: float = QUIET_WAIT_S,
                     stat: Path = Path("/proc/stat")) -> float:
    """The machine's busy share over the last sample once it is at most QUIET_BUSY_SHARE, or after
    `wait_s` whatever it is (0 where /proc/stat cannot tell)."""
    deadline = time.monotonic() + wait_s
    while True:
        before = _cpu_times(stat)
        time.sleep(sample_s)
        after = _cpu_times(stat)
        if before is None or after is None:
            return 0.0
        total = after[0] - before[0]
        share = 1 - (after[1] - before[1]) / total if total > 0 else 0.0
        if share <= QUIET_BUSY_SHARE or time.monotonic() >= deadline:
            return max(0.0, share)


def _cpu_times(stat: Path) -> tuple[int, int] | None:
    """(all jiffies, idle + iowait jiffies) of every core together."""
    try:
        fields = stat.read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    if not fields or fields[0] != "cpu":
        return None
    values = [int(value) for value in fields[1:]]
    return sum(values), values[3] + (values[4] if len(values) > 4 else 0)


def matmul_gflops(dtype: torch.dtype, seconds: float = 0.25) -> float:
    """A decoder projection's GFLOP/s over a 256-row prefill chunk (1024x1024, oneDNN with a packed
    weight where available): a quick figure of the CPU's matmul rate (bench suite's peak)."""
    from bulkinfer.engine.models.layers import Linear, onednn_linear_available

    layer = Linear(1024, 1024, bias=False).to(dtype).requires_grad_(False)
    if onednn_linear_available(torch.device("cpu"), dtype):
        layer.pack_for_onednn(256)
    rows = torch.randn(256, 1024).to(dtype)
    with torch.inference_mode():
        layer(rows)
        layer(rows)
        runs, started = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - started) < seconds or runs < 3:
            layer(rows)
            runs += 1
    return 2 * 256 * 1024 * 1024 * runs / elapsed / 1e9
