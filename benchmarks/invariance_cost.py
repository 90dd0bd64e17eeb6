"""Batch invariance's cost from two ``bench suite --json`` files, the engine with
``--batch-invariant off`` and with ``on`` (same model, device, workloads and scale): per dtype, the
suite's wall (every workload's, summed) in each and the ratio on / off.

    python -m bulkinfer.benchmarks.invariance_cost OFF.json ON.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def walls_by_dtype(figures: dict[str, Any]) -> dict[str, float]:
    """A suite JSON's total wall seconds per dtype, in the order the dtypes ran."""
    walls: dict[str, float] = {}
    for result in figures["bulkinfer"]:
        walls[result["dtype"]] = walls.get(result["dtype"], 0.0) + result["wall_s"]
    return walls


def cost_lines(off: dict[str, Any], on: dict[str, Any]) -> list[str]:
    """One line per dtype both runs measured: its walls off and on, and on / off."""
    walls_off, walls_on = walls_by_dtype(off), walls_by_dtype(on)
    lines = []
    for dtype, wall_off in walls_off.items():
        if dtype in walls_on:
            wall_on = walls_on[dtype]
            lines.append(f"{dtype}: batch invariance off {wall_off:.2f} s, on {wall_on:.2f} s, "
                         f"on/off {wall_on / wall_off:.3f}x ({(wall_on / wall_off - 1) * 100:+.1f}%)")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("off", type=Path, help="bench suite --batch-invariant off --json FILE")
    parser.add_argument("on", type=Path, help="bench suite --batch-invariant on --json FILE")
    args = parser.parse_args(argv)
    lines = cost_lines(json.loads(args.off.read_text()), json.loads(args.on.read_text()))
    if not lines:
        parser.error("the two files have no dtype in common")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
