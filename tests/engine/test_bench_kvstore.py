"""`bulkinfer bench kvstore` runs end to end on a tiny model and prints what a user reads (figures
are not asserted: speed lives in benchmarks, not tests)."""

from __future__ import annotations

import pytest

from bulkinfer.benchmarks.cli import main as bench_main


@pytest.mark.timeout(300)
def test_bench_kvstore_prints_both_runs_the_ratios_bytes_per_token_and_the_cpu(tiny_checkpoint, tmp_path,
                                                                               capsys) -> None:
    store = tmp_path / "store"
    code = bench_main(["kvstore", "--model", str(tiny_checkpoint), "--dtype", "float32",
                       "--prefix-tokens", "64", "--rows", "3", "--row-tokens", "4", "--max-tokens", "2",
                       "--store-dir", str(store), "--min-tokens", "0",
                       "--rounds", "2",
                       "--break-even", "--break-even-lengths", "16,32", "--repeats", "1"])
    out = capsys.readouterr().out
    assert code == 0
    assert "cpu: native bf16 " in out and "\ncpu: " in out
    assert "shard: 3 rows of a 64-token shared instruction + 4 own tokens, 2 output tokens each; " \
        "2 rounds, best of each" in out
    assert "stored: 4 blocks" in out  # the instruction's 4 full blocks, not the rows' own tokens
    assert "round 1: computed first row " in out and "round 2: " in out
    assert "bytes per token: fp32 " in out and ", bf16 " in out
    assert "computed (fresh engine, empty store): first row " in out
    assert "loaded (fresh engine, filled store):  first row " in out and "(4 blocks, " in out
    assert "first row: " in out and "x faster loaded (target >= 5x" in out
    assert "greedy outputs loaded vs computed: identical" in out
    assert "break-even (float32, one row, prefill only" in out and "break-even: " in out
    assert sorted(p.name for p in store.iterdir()) == ["round-0", "round-1"]
    assert len([p for p in (store / "round-0").rglob("*") if p.is_file()]) == 4


def test_bench_kvstore_refuses_a_store_that_is_not_empty(tiny_checkpoint, tmp_path, capsys) -> None:
    (tmp_path / "old").write_text("x")
    with pytest.raises(SystemExit):
        bench_main(["kvstore", "--model", str(tiny_checkpoint), "--store-dir", str(tmp_path)])
    assert "is not empty" in capsys.readouterr().err
