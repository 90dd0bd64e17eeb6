"""Every Triton kernel compiles for a Hopper GPU (sm_90) in the variants the engine launches, checked
without a GPU by Triton's own compiler (tests/engine/triton_compile.py, in a process of its own: this
suite runs the kernels under the interpreter, whose functions the compiler cannot take)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("triton_compile.py")


def test_every_kernel_compiles_for_sm90():
    result = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=300,
                            cwd=SCRIPT.parents[2])
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert len(lines) >= 13 and all(line.startswith("ok ") for line in lines), result.stdout
