"""Runs that kill their process are counted in Redis when they start (worker/shards/shard_crashes.py): the
shard is split down to the row that kills it, which alone becomes `worker_crashed`."""

from __future__ import annotations

import math
import multiprocessing
import os
import signal

import redis

from bulkinfer.jobs.formats.output import OutputRow
from bulkinfer.jobs.formats.rows import Row
from bulkinfer.jobs.sampling import JobSampling
from bulkinfer.worker.shards.shard_crashes import CrashHistory, ShardCrashes, run_split

NAMESPACE = "crash-test"


def rows(count: int) -> list[Row]:
    return [Row(index=n, row_id=f"r{n:02d}", prompt=f"row {n}", messages=None, sampling=JobSampling(),
                response_format=None) for n in range(count)]


def deliver(redis_url: str, job_id: str, count: int, poison: set[int], split_after: int,
            results: multiprocessing.Queue) -> None:
    """One delivery in a process of its own, run as shard_runner runs it; a poison row SIGKILLs it."""
    items = rows(count)
    crashes = ShardCrashes(redis.Redis.from_url(redis_url), NAMESPACE, job_id, 0, split_after)
    ran: list[int] = []

    def run_group(positions: list[int]) -> dict[int, OutputRow]:
        if poison & set(positions):
            os.kill(os.getpid(), signal.SIGKILL)
        ran.extend(positions)
        return {p: OutputRow(p, items[p].row_id, text="ok") for p in positions}

    history = crashes.history()
    with crashes.delivery():
        if history.split:
            outcomes = run_split(items, list(range(count)), history, crashes, run_group)
        else:
            outcomes = run_group(list(range(count)))
    assert outcomes is not None
    results.put(([(outcomes[p].row_id, outcomes[p].error_code) for p in range(count)], ran))


def until_done(redis_url: str, job_id: str, count: int, poison: set[int], split_after: int = 2
               ) -> tuple[list[tuple[str, str | None]], int]:
    """Deliver the shard again after every crash (as the reaper does); returns its outcomes and the
    number of crashes."""
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    for crashes in range(4 * count + 8):
        process = context.Process(target=deliver,
                                  args=(redis_url, job_id, count, poison, split_after, results))
        process.start()
        process.join(120)  # a wait, not a speed limit: a loaded machine runs the shard slowly
        if process.exitcode == 0:
            outcomes, _ = results.get(timeout=5)
            return outcomes, crashes
        assert process.exitcode == -signal.SIGKILL, process.exitcode
    raise AssertionError("the shard never ended")


def test_the_row_that_kills_its_worker_is_found_by_halving_and_every_other_row_runs(redis_url: str) -> None:
    outcomes, crashes = until_done(redis_url, "job-one-poison", 16, poison={11})
    assert [row_id for row_id, _ in outcomes] == [f"r{n:02d}" for n in range(16)]
    assert {row_id: code for row_id, code in outcomes if code} == {"r11": "worker_crashed"}
    assert crashes == 2 + math.ceil(math.log2(16))  # crash_split_after, then one per halving


def test_two_poison_rows_both_end_as_worker_crashed(redis_url: str) -> None:
    outcomes, crashes = until_done(redis_url, "job-two-poisons", 8, poison={0, 5}, split_after=1)
    assert {row_id: code for row_id, code in outcomes if code} == {"r00": "worker_crashed",
                                                                   "r05": "worker_crashed"}
    assert crashes <= 1 + 2 * math.ceil(math.log2(8))


def test_a_shard_that_never_crashes_runs_whole_and_leaves_no_crash() -> None:
    history = CrashHistory(whole=1, split_after=2)
    assert not history.split and history.outside_pieces == 0


def test_runs_that_end_in_python_are_not_crashes(redis_url: str) -> None:
    crashes = ShardCrashes(redis.Redis.from_url(redis_url), NAMESPACE, "job-exceptions", 3, split_after=1)
    for _ in range(3):
        try:
            with crashes.delivery(), crashes.running("0-2"):
                raise RuntimeError("an exception is an attempt (worker/shards/task_attempts.py), not a crash")
        except RuntimeError:
            pass
    assert crashes.history() == CrashHistory(whole=0, split_after=1)


def test_crashes_outside_the_pieces_of_a_split_shard_are_told_apart() -> None:
    # 2 crashes whole (then split), 1 in the piece 0-4, 2 more while reading or writing.
    history = CrashHistory(whole=5, split_after=2, pieces={"0-4": 1})
    assert history.split and history.outside_pieces == 2
