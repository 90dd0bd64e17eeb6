"""`bulkinfer bench vision` runs end to end (each side in its own process) and its Qwen2.5-VL preset has
Qwen2.5-VL-3B-Instruct's shape."""

from __future__ import annotations

import json
import math

import pytest

from bulkinfer.benchmarks.cli import main
from bulkinfer.engine.qwen_vl_checkpoint import QWEN_VL_PRESETS, qwen_vl_shapes


def test_bench_vision_prints_a_record_per_family_with_both_rates_and_the_ratio(
        capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["vision", "--family", "qwen2_5_vl", "--preset", "tiny", "--scale", "0.02",
                 "--max-tokens", "3", "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "workload: 5 rows over 1 images" in out
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [(r["family"], r["dtype"]) for r in records] == [("qwen2_5_vl", "float32")], out
    record = records[0]
    assert record["rows_per_s"] > 0 and record["baseline_rows_per_s"] > 0
    assert record["ratio"] == pytest.approx(record["rows_per_s"] / record["baseline_rows_per_s"], rel=0.02)
    # One distinct image: the tower runs once; the other rows reuse its prompt from the prefix cache.
    assert record["encoder_cache_misses"] == 1 and record["prefix_cache_hit_rate"] > 0.3


def test_an_unknown_family_is_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["vision", "--family", "llava"])
    assert "unknown --family llava" in capsys.readouterr().err


def test_the_qwen_preset_has_qwen2_5_vl_3b_shape() -> None:
    preset = QWEN_VL_PRESETS["qwen2.5-vl-3b"]
    shapes = qwen_vl_shapes(preset.vocab, "qwen2.5-vl-3b")
    assert sum(math.prod(shape) for shape in shapes.values()) == 3_754_622_976
    assert "lm_head.weight" not in shapes  # tied, as published
    assert sum(preset.mrope_section) == preset.hidden // preset.heads // 2
