"""The roofline benchmark (benchmarks/roofline.py) and the baseline comparison (benchmarks/gpu_baseline.py):
run end to end on a tiny model on the CPU, their figures present, positive and self-consistent (speed
itself lives in benchmarks, not tests)."""

from __future__ import annotations

import json
import re

import pytest

from bulkinfer.benchmarks import gpu_baseline
from bulkinfer.benchmarks.roofline import ModelShape, decode_cost, main, prefill_flops


def test_decode_cost_counts_the_weights_once_and_a_shared_prefix_once() -> None:
    shape = ModelShape(layer_params=90, step_params=100, weight_bytes=200, num_layers=2, query_width=8,
                       kv_bytes_per_token=10)
    nbytes, flops = decode_cost(shape, [20, 30], shared_prefix=0)
    assert nbytes == 200 + 10 * 50 and flops == 2 * 100 * 2 + 4 * 2 * 8 * 50
    nbytes, flops = decode_cost(shape, [20, 30], shared_prefix=16)  # 16 read once, 4 + 14 each
    assert nbytes == 200 + 10 * (16 + 4 + 14) and flops == 2 * 100 * 2 + 4 * 2 * 8 * 50
    # layers x tokens, one LM-head row, attention over 1 + 2 + 3 + 4 positions
    assert prefill_flops(shape, 4) == 2 * 90 * 4 + 2 * 10 + 4 * 2 * 8 * 10


@pytest.mark.timeout(120)
@pytest.mark.parametrize("async_scheduling", ["auto", "on"])  # on: what a GPU runs by default
def test_a_tiny_roofline_run_prints_and_writes_every_figure(tiny_checkpoint, tmp_path, capsys,
                                                            async_scheduling) -> None:
    out = tmp_path / "roofline.json"
    assert main(["--model", str(tiny_checkpoint), "--device", "cpu", "--dtype", "float32", "--rows", "2,4",
                 "--context", "32", "--prefill-tokens", "64", "--warmup", "1", "--steps", "2",
                 "--prefill-reps", "1", "--copy-mib", "8", "--gemm-size", "128", "--json", str(out),
                 "--async-scheduling", async_scheduling]) == 0
    printed = capsys.readouterr().out
    assert re.search(r"^device: cpu \(.+\)", printed, re.M)
    assert re.search(r"copy bandwidth [\d.,]+ GB/s .* float32 matmul [\d.,]+ [GT]FLOP/s", printed)
    assert re.search(r"^prefill: 64 tokens in one step, [\d.]+ ms, .*MFU [\d.]+% \(target", printed, re.M)
    figures = json.loads(out.read_text())
    assert figures["device_kind"] == "cpu" and figures["dtype"] == "float32"
    assert figures["copy_bytes_per_s"] > 0 and figures["matmul_flops_per_s"] > 0
    cases = {(c["case"], c["rows"]): c for c in figures["decode"]}
    assert set(cases) == {("unique", 2), ("unique", 4), ("shared", 2), ("shared", 4)}
    for case in cases.values():
        for name in ("context", "step_ms", "bytes", "flops", "memory_ms", "compute_ms", "roofline_ms"):
            assert case[name] > 0, name
        assert case["roofline_ms"] == max(case["memory_ms"], case["compute_ms"])
        assert case["ratio"] > 0 and case["ratio"] == pytest.approx(case["roofline_ms"] / case["step_ms"])
        assert 32 <= case["context"] < 32 + 12  # the prompt, plus the steps decoded so far
        assert f"| {case['case']} | {case['rows']} | " in printed
    # the shared prefix's K/V once: fewer bytes than the same rows' own contexts
    assert cases[("shared", 4)]["bytes"] < cases[("unique", 4)]["bytes"]
    prefill = figures["prefill"]
    assert prefill["tokens"] == 64 and prefill["ms"] > 0 and prefill["flops"] > 0 and prefill["mfu"] > 0


def test_the_suite_comparison_prints_each_workload_beside_the_earlier_figure(tmp_path, capsys) -> None:
    baseline = gpu_baseline.load_baseline()
    assert baseline is not None and baseline["shapes"]["smollm2"]["step_ms"] == {"128": 64.0, "512": 118.2}
    model = tmp_path / "big"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": 2048, "num_hidden_layers": 16}))
    suite = tmp_path / "suite.json"
    runs = {"shared-4x400": 31660.0, "unique": 1053.0, "mixed": 99.0}
    results = [{"workload": name, "dtype": "bfloat16", "resolved_dtype": "bfloat16", "output_tps": tps}
               for name, tps in runs.items()]
    suite.write_text(json.dumps({"bulkinfer": results}))
    assert gpu_baseline.main([f"{model}={suite}", f"smollm2={tmp_path / 'missing.json'}"]) == 0
    printed = capsys.readouterr().out
    assert "| 1b | shared-4x400 | bfloat16 | 3,166 | 31,660 | 10.00x | >= 10x: met |" in printed
    assert "| 1b | unique | bfloat16 | 1,053 | 1,053 | 1.00x |  |" in printed
    assert "mixed" not in printed  # no earlier figure to stand beside
    assert "missing.json not written" in printed
