"""benchmarks/invariance_cost.py: the suite's walls with batch invariance off and on, per dtype."""

from __future__ import annotations

from bulkinfer.benchmarks.invariance_cost import cost_lines


def _suite(*results: tuple[str, str, float]) -> dict:
    return {"bulkinfer": [{"workload": w, "dtype": d, "wall_s": s} for w, d, s in results]}


def test_each_dtypes_walls_are_summed_over_workloads_and_compared() -> None:
    off = _suite(("short", "bfloat16", 1.0), ("long", "bfloat16", 3.0), ("short", "float32", 2.0))
    on = _suite(("short", "bfloat16", 1.5), ("long", "bfloat16", 3.5), ("short", "float32", 2.0))
    assert cost_lines(off, on) == [
        "bfloat16: batch invariance off 4.00 s, on 5.00 s, on/off 1.250x (+25.0%)",
        "float32: batch invariance off 2.00 s, on 2.00 s, on/off 1.000x (+0.0%)"]
