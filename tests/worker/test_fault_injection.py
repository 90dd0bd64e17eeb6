"""The kill-marker fault injection (worker/shards/fault_injection.py) is off unless the worker's own
environment turns it on, and then it is a real SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bulkinfer.worker.shards.fault_injection import KILL_MARKER_ENV, kill_marker

REPO = Path(__file__).resolve().parents[2]
MARKED_ROW = """
from bulkinfer.jobs.formats.rows import Row
from bulkinfer.jobs.sampling import JobSampling
from bulkinfer.worker.shards.fault_injection import kill_if_marked
kill_if_marked([Row(0, "a", "say hi", None, JobSampling(), None),
                Row(1, "b", "x poison-0123456789abcdef y", None, JobSampling(), None)])
print("alive")
"""


def run_marked_row(marker: str | None) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if key != KILL_MARKER_ENV}
    if marker is not None:
        env[KILL_MARKER_ENV] = marker
    return subprocess.run([sys.executable, "-c", MARKED_ROW], cwd=REPO, env={**env, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=60)


def test_a_row_with_the_marker_kills_the_worker_only_when_its_environment_sets_the_marker() -> None:
    assert run_marked_row("poison-0123456789abcdef").returncode == -signal.SIGKILL
    unset = run_marked_row(None)
    assert (unset.returncode, unset.stdout.strip()) == (0, "alive")


def test_a_short_marker_turns_nothing_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KILL_MARKER_ENV, "poison")  # would match ordinary text
    assert kill_marker() is None
    assert run_marked_row("poison").returncode == 0
