"""`bulkinfer bench host` runs the real engine host path against a simulated device and reports one
record per case (figures are not asserted beyond what holds on any machine: speed lives in
benchmarks, not tests)."""

from __future__ import annotations

import json

import pytest

from bulkinfer.benchmarks.host_bench import bench_cli


@pytest.mark.timeout(300)
def test_bench_host_reports_every_kind_and_loop_as_json(real_model,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    code = bench_cli(["--model", str(real_model), "--rows", "4,8", "--steps", "3", "--device-ms", "2",
                      "--json"])
    assert code == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    cases = {(r["kind"], r["rows"], r["mode"]) for r in records}
    expected = {(kind, rows, mode) for kind in ("decode", "mixed", "structured", "ngram") for rows in (4, 8)
                for mode in ("sync", "async")}
    assert cases == expected
    for record in records:
        assert record["device_ms"] == 2 and record["steps"] == 3
        assert record["host_ms"] > 0 and record["busy_ms"] >= 1.9  # the stand-in held its time
        # A step cannot end before its device time; the synchronous loop adds the host's on top.
        assert record["wall_ms"] >= record["busy_ms"] * 0.95
        assert set(record) >= {"kind", "rows", "device_ms", "host_ms", "wall_ms", "exposed_ms",
                               "wall_over_max"}


def test_bench_host_refuses_an_unknown_kind(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench_cli(["--kinds", "decode,prefill"])
    assert "unknown kinds ['prefill']" in capsys.readouterr().err
