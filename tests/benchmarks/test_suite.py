"""`bulkinfer bench suite`: workloads of the stated shapes, and figures that add up."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from bulkinfer.benchmarks.suite import (
    WORKLOADS,
    Distribution,
    SuiteWorkload,
    bench_cli,
    make_workloads,
    model_flops,
)


def test_each_workload_has_the_stated_lengths_and_scale_changes_only_the_counts() -> None:
    full = {w.name: w for w in make_workloads(WORKLOADS, 2048, {0, 1, 2})}
    assert [len(full[name].prompts) for name in WORKLOADS] == [256, 96, 128, 256, 16, 32, 128]
    shared = full["shared-4x400"]
    assert {len(p) for p in shared.prompts} == {450} and len({tuple(p[:400]) for p in shared.prompts}) == 4
    eight = full["shared-8x300"].prompts
    assert {len(p) for p in eight} == {350} and len({tuple(p[:300]) for p in eight}) == 8
    assert set(full["shared-8x300"].max_tokens) == {64}
    assert {len(p) for p in full["long-prompt"].prompts} == {2000}
    assert set(full["long-output"].max_tokens) == {512}
    assert all(16 <= n <= 256 for n in full["mixed"].max_tokens)
    assert not any(t in {0, 1, 2} for p in full["unique"].prompts for t in p)  # never a special token
    small = {w.name: w for w in make_workloads(["shared-4x400"], 2048, set(), scale=0.1)}
    prompts = small["shared-4x400"].prompts
    assert len(prompts) == 26 and {len(p) for p in prompts} == {450}
    with pytest.raises(ValueError, match="unknown workload 'huge'"):
        make_workloads(["huge"], 2048, set())


def test_model_flops_count_projections_head_and_attended_positions() -> None:
    layer = SimpleNamespace(parameters=lambda: [SimpleNamespace(numel=lambda: 100)])
    config = SimpleNamespace(num_heads=2, head_dim=4, num_layers=3)
    model = SimpleNamespace(config=config, layers=[layer, layer],
                            lm_head=SimpleNamespace(weight=SimpleNamespace(numel=lambda: 50)))
    workload = SuiteWorkload("w", [[5] * 10], [3])
    output = SimpleNamespace(num_cached_tokens=4, num_completion_tokens=3)
    # Computed positions 5..12 (tokens 4..11: the 6 uncached prompt tokens, then 2 fed-back outputs).
    computed, attended = 12 - 4, sum(range(5, 13))
    expected = 2 * 200 * computed + 2 * 50 * 3 + 4 * 3 * 8 * attended
    assert model_flops(model, workload, [output]) == expected


def test_percentiles_of_a_distribution() -> None:
    d = Distribution.of([float(n) for n in range(1, 101)])
    assert (d.mean, d.p50, d.p99) == (50.5, 51.0, 99.0)
    assert Distribution.of([]) == Distribution(0.0, 0.0, 0.0)


def test_the_suite_prints_a_table_and_writes_figures_that_add_up(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "suite.json"
    assert bench_cli(["--preset", "tiny", "--dtype", "float32", "--workloads", "shared-4x400,long-output",
                      "--scale", "0.05", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| shared-4x400 | float32 | 13 |" in printed and "| long-output | float32 | 2 |" in printed
    shared, long_output = json.loads(out.read_text())["bulkinfer"]
    assert shared["output_tokens"] == 13 * 64 and long_output["output_tokens"] == 2 * 512
    assert shared["prefix_hit_rate"] > 0.5  # 13 rows over 4 instructions: 9 reuse one
    for result in (shared, long_output):
        assert result["output_tps"] == pytest.approx(result["output_tokens"] / result["wall_s"])
        assert 0 < result["mfu"] < 1 and result["peak_gflops"] > 0 and result["peak_rss_mib"] > 0
        assert result["load_s"] > 0 and result["resolved_dtype"] == "float32"
        for name in ("ttft_s", "itl_s", "tpot_s"):
            assert 0 <= result[name]["p50"] <= result[name]["p99"]


def test_the_kv_populate_setting_reaches_the_engine() -> None:
    # The engine validates it: a value it refuses proves the suite handed it over.
    with pytest.raises(ValueError, match="kv_populate_seconds must be a finite number of seconds >= 0"):
        bench_cli(["--preset", "tiny", "--dtype", "float32", "--workloads", "long-output", "--scale", "0.05",
                   "--kv-populate-seconds", "-1"])
