"""The engine benchmark command runs end to end (figures are not asserted: speed lives in
benchmarks, not tests) and reports what a user reads."""

from __future__ import annotations

import pytest

from engine.bench import bench_cli


@pytest.mark.timeout(300)
def test_bench_engine_prints_both_runs_and_the_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    code = bench_cli(["--preset", "tiny", "--requests", "8", "--shared-len", "32", "--tail-len", "8",
                      "--max-tokens", "4", "--baseline-batch", "4"])
    out = capsys.readouterr().out
    assert code == 0
    for workload in ("shared-prefix", "no-shared-prefix"):
        assert f"workload: {workload} — 8 requests, 320 prompt tokens, 4 output tokens each" in out
    assert out.count("engine / baseline output tok/s") == 2
    assert "prefix-cache hit rate" in out
