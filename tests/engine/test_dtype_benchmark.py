"""The reference workload behind a kept dtype verdict (engine/dtype_benchmark.py): both dtypes in
alternating order, several rounds, each one's median, after waiting for a quiet machine. Checked
with a scripted timer (no timed assertion), and once through the engine's real projections."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest
import torch

from bulkinfer.engine.dtype_benchmark import (
    MIN_SPEEDUP,
    ReferenceWorkload,
    measure_bf16_verdict,
    timed_rounds,
    verdict_from_times,
    wait_until_quiet,
)

F32, BF16 = torch.float32, torch.bfloat16


def test_rounds_alternate_the_dtypes_and_take_each_ones_median() -> None:
    calls: list[tuple[torch.dtype, str]] = []
    # fp32 decode: one disturbed round (9.0) that a mean would carry and the median drops
    script = {(F32, "decode"): iter([1.0, 9.0, 1.2]), (F32, "prefill"): iter([4.0, 4.2, 3.8]),
              (BF16, "decode"): iter([0.5, 0.6, 0.4]), (BF16, "prefill"): iter([4.4, 4.0, 4.2])}

    def timer(dtype: torch.dtype, shape: str) -> float:
        calls.append((dtype, shape))
        return next(script[(dtype, shape)])

    medians = timed_rounds(timer, rounds=3)
    assert medians == {(F32, "decode"): 1.2, (F32, "prefill"): 4.0, (BF16, "decode"): 0.5,
                       (BF16, "prefill"): 4.2}
    first_of_each_round = [calls[i][0] for i in range(0, len(calls), 4)]
    assert first_of_each_round == [F32, BF16, F32]


def test_bf16_is_chosen_only_when_it_beats_fp32_clearly_on_the_whole_workload() -> None:
    when = datetime(2026, 5, 1, 10, 0, tzinfo=UTC)
    clear = verdict_from_times({(F32, "decode"): 2.0, (F32, "prefill"): 4.0, (BF16, "decode"): 1.0,
                                (BF16, "prefill"): 3.0}, rounds=5, busy=0.1, workload="w", now=when)
    assert (clear.dtype, clear.speedup, clear.decode_speedup) == ("bfloat16", 1.5, 2.0)
    assert clear.prefill_speedup == round(4.0 / 3.0, 3) and clear.measured_at == "2026-05-01T10:00Z"
    close = verdict_from_times({(F32, "decode"): 1.0, (F32, "prefill"): 4.0, (BF16, "decode"): 0.5,
                                (BF16, "prefill"): 4.0}, rounds=5, busy=0.1, workload="w", now=when)
    assert close.speedup < MIN_SPEEDUP and close.dtype == "float32"  # decode 2x, but not the whole


class _Stat:
    """/proc/stat read after read: (busy, idle) jiffies of every core, as they grow."""

    def __init__(self, readings: list[tuple[int, int]]) -> None:
        self.readings = iter(readings)

    def read_text(self) -> str:
        busy, idle = next(self.readings)
        return f"cpu  {busy} 0 0 {idle} 0 0 0 0 0 0\ncpu0 1 2 3 4\n"


def test_the_measurement_waits_for_a_quiet_machine() -> None:
    # 90% busy over the first sample, then 10%: measured after the second
    stat = _Stat([(0, 0), (90, 10), (90, 10), (100, 100)])
    assert wait_until_quiet(sample_s=0, wait_s=60, stat=stat) == pytest.approx(0.1)  # type: ignore[arg-type]
    # never quiet: measured anyway once the wait is over, saying how busy it was
    busy = _Stat([(0, 0), (95, 5)])
    assert wait_until_quiet(sample_s=0, wait_s=0, stat=busy) == pytest.approx(0.95)  # type: ignore[arg-type]
    assert wait_until_quiet(sample_s=0, wait_s=0, stat=Path("/nonexistent/stat")) == 0.0


def test_the_real_workload_runs_through_the_engines_projections() -> None:
    tiny = ReferenceWorkload(hidden=64, intermediate=96, kv_width=32, decode_rows=2, prefill_rows=8,
                             decode_passes=2, rounds=3)
    verdict = measure_bf16_verdict(tiny, busy=lambda: 0.5)
    assert verdict.dtype in ("bfloat16", "float32") and verdict.rounds == 3 and verdict.busy == 0.5
    assert verdict.speedup > 0 and verdict.decode_speedup > 0 and verdict.prefill_speedup > 0
    assert verdict.workload == "layer 64x96, decode 2 rows x2, prefill 8 rows"
