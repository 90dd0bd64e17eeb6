"""`bulkinfer bench service` as a user runs it: a real stack, a real job, the engine alone; the
printed figures are checked for presence and consistency, never for speed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.services import REPO_ROOT

pytestmark = pytest.mark.timeout(300)


def test_bench_service_prints_both_timings_and_the_ratio(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "bulkinfer.api.cli", "bench", "service", "--preset", "tiny", "--requests",
         "16",
         "--max-tokens", "8", "--shard-size", "8", "--shared-len", "40", "--tail-len", "10",
         "--home", str(tmp_path)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=280)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "rows: 16 written (800 prompt tokens" in output  # the workload's exact token counts
    assert "end-to-end: all 16 rows present once, " in output
    sides = re.findall(r"^  (end to end|engine only) .* wall +[\d.]+s +rows 16 +tokens: prompt 800, "
                       r"cached (\d+), completion \d+ +output +[\d.]+ tok/s +load [\d.]+ → [\d.]+$",
                       output, re.MULTILINE)
    assert [side for side, _ in sides] == ["end to end", "engine only"], output
    assert "same prompt and completion tokens on both sides: yes" in output
    # Both sides compute in one dtype: the engine alone takes the worker's (auto chose it per machine)
    assert re.search(r"^dtype: the worker computed in (float32|bfloat16); the engine alone runs in \1$",
                     output, re.MULTILINE), output
    assert re.search(r"\(2 shards\)$", output, re.MULTILINE)
    busy = re.search(r"engine busy: worker ([\d.]+)s of [\d.]+s \(\d+%\), engine alone ([\d.]+)s", output)
    assert busy and float(busy[1]) > 0 and float(busy[2]) > 0, output  # both engines ran, and said so
    assert re.search(r"end-to-end / engine-only wall: [\d.]+x \(target <= 1\.05x: (met|NOT met)\)", output)
