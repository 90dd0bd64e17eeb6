"""`bulkinfer bench faults`: faults injected into real workers and Redis, every output row counted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.faults import bench_cli, count_rows

pytestmark = pytest.mark.timeout(600)


def test_rows_lost_and_duplicated_are_counted_from_the_output_parts(tmp_path: Path) -> None:
    output = tmp_path / "jobs" / "job-a" / "output"
    output.mkdir(parents=True)
    (output / "part-00000.jsonl").write_text("".join(json.dumps({"id": i}) + "\n" for i in ["a", "b", "b"]))
    (output / "part-00001.jsonl").write_text(json.dumps({"id": "stranger"}) + "\n")
    assert count_rows(tmp_path, {"job-a": ["a", "b", "c"]}) == {"rows_lost": 1, "rows_duplicated": 2}


def test_bench_faults_kills_stalls_and_cuts_off_workers_and_redis_and_loses_no_row(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    code = bench_cli(["--rows", "60", "--jobs", "2", "--shard-size", "10", "--timeout", "240", "--json",
                      "--home", str(tmp_path)])
    lines = capsys.readouterr().out.strip().splitlines()
    figures = json.loads(lines[-1])
    assert code == 0, lines
    assert figures["faults"] == ["worker-kill", "redis-restart", "worker-stall", "redis-pause", "worker-kill"]
    assert figures["faults_injected"] == 5
    assert (figures["jobs_completed"], figures["rows_lost"], figures["rows_duplicated"]) == (2, 0, 0)
    assert any(line.strip().startswith("rows lost") for line in lines)


def test_bench_faults_poison_row_ends_as_worker_crashed_and_every_other_row_once(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    code = bench_cli(["--rows", "8", "--jobs", "1", "--shard-size", "2", "--faults", "poison-row",
                      "--timeout", "300", "--json", "--home", str(tmp_path)])
    lines = capsys.readouterr().out.strip().splitlines()
    figures = json.loads(lines[-1])
    assert code == 0, lines
    assert (figures["jobs_completed"], figures["jobs"]) == (2, 2)  # the bench's job and the poison job
    poison = (figures["poison_rows"], figures["rows_worker_crashed"], figures["worker_crashed_wrong"])
    assert poison == (1, 1, 0)
    assert (figures["rows_lost"], figures["rows_duplicated"]) == (0, 0)
    # Its shard of 2 crashed crash_split_after (2) times whole, then once alone: no more.
    assert figures["worker_deaths"] == 3
