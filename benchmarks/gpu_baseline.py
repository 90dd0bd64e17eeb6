"""The 2026-12-04 GPU figures (gpu_baseline_2026-12-04.json), and the suite's new ones beside them.

    python -m bulkinfer.benchmarks.gpu_baseline smollm2=gpu_suite.json MODEL_DIR=gpu_suite_big.json

Each SHAPE=FILE pairs a suite's `--json` output with a shape of the baseline file, named (smollm2,
1b) or as the model folder the suite ran, whose config.json says which shape it is; every workload
run in a dtype the baseline has prints its output tok/s beside the earlier figure and the ratio.
The earlier suite ran at `--scale 2` (gpu_check.sh now runs `--scale 1`: half the requests, the
same lengths), so a ratio near 1 is noise, not a change.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

BASELINE = Path(__file__).with_name("gpu_baseline_2026-12-04.json")


def load_baseline(path: Path = BASELINE) -> dict[str, Any] | None:
    """The baseline file's figures, or None where it is absent (an installed wheel need not carry it)."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def shape_key(baseline: dict[str, Any], hidden_size: int, num_layers: int) -> str | None:
    """Which of the baseline's shapes a model of this width and depth is (None: none of them)."""
    for key, shape in baseline["shapes"].items():
        if shape["hidden_size"] == hidden_size and shape["num_hidden_layers"] == num_layers:
            return key
    return None


def shape_of(baseline: dict[str, Any], name: str) -> str | None:
    """A baseline shape's key: `name` itself, or the shape of the model folder `name`."""
    if name in baseline["shapes"]:
        return name
    config = Path(name) / "config.json"
    if not config.is_file():
        return None
    values = json.loads(config.read_text())
    return shape_key(baseline, values.get("hidden_size"), values.get("num_hidden_layers"))


def compare_suite(baseline: dict[str, Any], key: str, results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per suite result with an earlier figure: workload, dtype, then, now, ratio, target."""
    shape = baseline["shapes"][key]
    target = baseline["targets"]["suite_speedup_1b_shared"]
    rows = []
    for result in results:
        dtype = result.get("resolved_dtype") or result["dtype"]
        then = shape["suite_output_tps"].get(dtype, {}).get(result["workload"])
        if not then:
            continue
        now = float(result["output_tps"])
        wants = target if result["workload"] in shape.get("shared_workloads", ()) else None
        rows.append({"shape": key, "workload": result["workload"], "dtype": dtype, "then": float(then),
                     "now": now, "ratio": now / then, "target": wants})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bulkinfer.benchmarks.gpu_baseline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pairs", nargs="+", metavar="SHAPE=FILE", help="a baseline shape and a suite's JSON")
    parser.add_argument("--baseline", type=Path, default=BASELINE)
    args = parser.parse_args(argv)
    baseline = load_baseline(args.baseline)
    if baseline is None:
        parser.error(f"{args.baseline}: not found")
    print(f"suite output tok/s against {baseline['date']} ({baseline['device']}):")
    print("| shape | workload | dtype | then | now | now / then | target |")
    print("| --- | --- | --- | ---: | ---: | ---: | --- |")
    for pair in args.pairs:
        left, _, name = pair.rpartition("=")
        if not left or not name:
            parser.error(f"{pair!r}: expected SHAPE=FILE (SHAPE: {sorted(baseline['shapes'])} or a model)")
        key, path = shape_of(baseline, left), Path(name)
        if key is None:
            known = (Path(left) / "config.json").is_file()
            why = "no earlier figures for this shape" if known else "no model there"
            print(f"| {left} | ({why}) | | | | | |")
            continue
        if not path.is_file():  # its suite failed or ran out of time: say so, compare the rest
            print(f"| {key} | ({path} not written) | | | | | |")
            continue
        for row in compare_suite(baseline, key, json.loads(path.read_text())["bulkinfer"]):
            verdict = ""
            if row["target"]:
                verdict = f">= {row['target']:g}x: {'met' if row['ratio'] >= row['target'] else 'not yet'}"
            print(f"| {key} | {row['workload']} | {row['dtype']} | {row['then']:,.0f} | {row['now']:,.0f} | "
                  f"{row['ratio']:.2f}x | {verdict} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
