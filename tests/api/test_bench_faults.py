"""`bulkinfer bench faults`: faults injected into real workers and Redis, every output row counted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bulkinfer.benchmarks.faults import bench_cli, count_rows

pytestmark = pytest.mark.timeout(720)


def test_rows_lost_and_duplicated_are_counted_from_the_output_parts(tmp_path: Path) -> None:
    output = tmp_path / "jobs" / "job-a" / "output"
    output.mkdir(parents=True)
    (output / "part-00000.jsonl").write_text("".join(json.dumps({"id": i}) + "\n" for i in ["a", "b", "b"]))
    (output / "part-00001.jsonl").write_text(json.dumps({"id": "stranger"}) + "\n")
    assert count_rows(tmp_path, {"job-a": ["a", "b", "c"]}) == {"rows_lost": 1, "rows_duplicated": 2}


def test_bench_faults_kills_stalls_fills_cuts_off_and_poisons_workers_redis_and_the_disk_and_loses_no_row(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Short leases (stalls and outages last three, the long outage 12 s) and small shards (the poison
    # row's shard of 4 splits to it in fewer crashes): every fault, in under two minutes.
    code = bench_cli(["--rows", "40", "--jobs", "2", "--shard-size", "4", "--timeout", "560", "--json",
                      "--lease-ttl", "2", "--home", str(tmp_path)])
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    # Before parsing (a failed run prints no figures); a str message, which pytest never shortens.
    assert code == 0, f"exit {code}\n{captured.err[-4000:]}\n{captured.out[-2000:]}"
    figures = json.loads(lines[-1])
    assert figures["faults"] == ["worker-kill", "redis-restart", "worker-stall", "redis-pause", "disk-full",
                                 "redis-oom", "redis-outage-long", "worker-term", "poison-row"]
    assert figures["faults_injected"] == 9
    # The poison job (one row kills its worker): that row alone ends worker_crashed, every other row once.
    poison = (figures["poison_rows"], figures["rows_worker_crashed"], figures["worker_crashed_wrong"])
    assert poison == (1, 1, 0)
    assert figures["worker_deaths"] >= 3  # crash_split_after (2) whole-shard crashes, then the halves'
    assert figures["jobs"] == 4  # the two, the poison job and the one planned while the disk was full
    assert (figures["jobs_completed"], figures["rows_lost"], figures["rows_duplicated"]) == (4, 0, 0)
    # No worker's consumer stalled (a task result refused under Redis's memory limit once left its
    # message unacknowledged: the worker took nothing more until its watchdog stopped it 60 s later).
    assert figures["consumer_stalls"] == 0
    assert any(line.strip().startswith("rows lost") for line in lines)
    log = {record["fault"]: record for record in figures["fault_log"]}
    assert list(log) == figures["faults"]
    # The disk was full for the workers (writes refused), and the jobs still succeeded.
    assert log["disk-full"]["enospc_errors_logged"] >= 1
    # The shards a Redis outage longer than the lease caught running were committed by the runs that
    # had them, not thrown away and computed again.
    assert log["redis-outage-long"]["shards_recomputed"] == 0
