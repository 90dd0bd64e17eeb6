"""`bulkinfer bench lora` runs end to end and prints what a user reads (figures are not asserted:
speed lives in benchmarks, not tests)."""

from __future__ import annotations

import pytest

from bulkinfer.benchmarks.cli import main as bench_main


@pytest.mark.timeout(300)
def test_bench_lora_prints_the_three_runs_and_both_ratios(tiny_checkpoint, tmp_path, capsys) -> None:
    code = bench_main(["lora", "--model", str(tiny_checkpoint), "--rows", "8", "--adapters", "2",
                       "--prompt-len", "8", "--max-tokens", "2", "--dtype", "float32",
                       "--adapters-dir", str(tmp_path), "--rounds", "1"])
    out = capsys.readouterr().out
    assert code == 0
    assert "rows: 8 (8 prompt tokens, 2 output tokens each) x 1 rounds, 2 adapters of rank 16 " \
        "on q_proj" in out
    assert "dtype float32" in out and "cpu: native bf16 " in out
    for line in ("base (no adapter)", "mixed (2 adapters, one run)", "one adapter after another",
                 "mixed / base throughput: ", "mixed vs one after another: "):
        assert line in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter-0", "adapter-1"]
