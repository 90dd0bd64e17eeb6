"""A running shard's finished rows reach Redis as they finish, at a bounded rate
(worker/shards/shard_progress.py, worker/hosts/finished_rows.py, the row loop's reports). No
engine, no clock: futures are completed by hand and time is a counter."""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import redis

from bulkinfer.jobs.formats.output import OutputRow
from bulkinfer.jobs.formats.rows import Row, RowError, RowErrorCode
from bulkinfer.jobs.sampling import JobSampling
from bulkinfer.jobs.state.live_progress import LiveFigures
from bulkinfer.worker.hosts import row_window
from bulkinfer.worker.hosts.engine_rows import request_figures
from bulkinfer.worker.hosts.finished_rows import FinishedRows
from bulkinfer.worker.shards.shard_progress import ShardProgress, settled_figures

GREEDY = JobSampling(temperature=0.0, max_tokens=2)


class RecordingLive:
    """Stands for LiveProgress: what would be written to Redis, in order."""

    def __init__(self, failing: bool = False) -> None:
        self.writes: list[LiveFigures] = []
        self.cleared = 0
        self.failing = failing

    def write(self, shard_index: int, generation: int, figures: LiveFigures) -> bool:
        if self.failing:
            raise redis.ConnectionError("Redis is down")
        self.writes.append(figures)
        return True

    def clear(self, shard_index: int, generation: int) -> None:
        if self.failing:
            raise redis.ConnectionError("Redis is down")
        self.cleared += 1


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def row(index: int) -> Row:
    return Row(index, f"r{index}", f"prompt {index}", None, GREEDY, None)


def completed(index: int, completion_tokens: int = 2) -> OutputRow:
    return OutputRow.completed(row(index), "ok", "stop", prompt_tokens=5, cached_tokens=1,
                               completion_tokens=completion_tokens)


def test_rows_are_written_at_most_once_per_interval_whatever_the_throughput() -> None:
    live, clock = RecordingLive(), Clock()
    progress = ShardProgress(live, 0, 1, interval_s=1.0, clock=clock)  # type: ignore[arg-type]
    with progress.of_this_run():
        assert live.writes == [LiveFigures()]  # a rerun starts by replacing what a crashed run left
        for index in range(5000):  # a fast engine: thousands of rows inside one interval
            progress.update([completed(index)])
            clock.now += 0.0001
        assert len(live.writes) == 1
        clock.now += 1.0
        progress.update([completed(5000)])
        assert len(live.writes) == 2 and live.writes[-1].succeeded == 5001
        progress.update([], LiveFigures(failed=1))  # a row finished inside a window still running
        progress.flush()  # the rows are done: written at once, before the parts
        assert live.writes[-1] == LiveFigures(succeeded=5001, failed=1, prompt=5 * 5001, cached=5001,
                                              completion=2 * 5001)
        progress.flush()
        assert len(live.writes) == 3  # nothing changed: nothing written
    assert live.cleared == 1  # the run ended: what its commit did not take goes


def test_a_redis_that_refuses_writes_never_fails_the_shard() -> None:
    progress = ShardProgress(RecordingLive(failing=True), 0, 1, clock=Clock())  # type: ignore[arg-type]
    with progress.of_this_run():
        progress.update([completed(0)])
        progress.flush()
    assert progress.figures.succeeded == 1


def test_settled_rows_count_as_the_shard_result_counts_them() -> None:
    copy = OutputRow.completed(row(1), "ok", "stop", prompt_tokens=5, cached_tokens=1, completion_tokens=2)
    copy = dataclasses.replace(copy, deduplicated=True)
    failed = OutputRow.from_error(RowError(2, "r2", RowErrorCode.INVALID_JSON, "bad line"))
    assert settled_figures([completed(0), copy, failed]) == LiveFigures(
        succeeded=2, failed=1, deduplicated=1, prompt=5, cached=1, completion=2)


def result(finish_reason: str = "stop", completion: int = 3) -> SimpleNamespace:
    sample = SimpleNamespace(finish_reason=finish_reason)
    return SimpleNamespace(finish_reason=finish_reason, outputs=[sample], num_prompt_tokens=7,
                           num_cached_tokens=2, num_completion_tokens=completion, metrics=None)


def test_each_request_is_counted_once_as_it_finishes_with_the_rows_that_copy_it() -> None:
    futures: list[Future] = [Future(), Future(), Future()]
    rows = FinishedRows([([futures[0]], 2), ([futures[1]], 0), ([futures[2]], 0)], request_figures,
                        failed_at_once=1)
    assert rows.figures() == LiveFigures(failed=1)  # a row that could not run is done at once
    futures[0].set_result(result())
    assert rows.figures() == LiveFigures(succeeded=3, failed=1, deduplicated=2, prompt=7, cached=2,
                                         completion=3)
    assert rows.figures().succeeded == 3  # looked at again: not counted again
    futures[1].set_result(result("abort", completion=0))
    futures[2].set_exception(RuntimeError("the engine died"))  # outputs() raises it; nothing counted
    assert rows.figures() == LiveFigures(succeeded=3, failed=2, deduplicated=2, prompt=7, cached=2,
                                         completion=3)


class ScriptedRun:
    """A window in the engine that finishes its rows one poll at a time."""

    def __init__(self, items: list[Row | RowError]) -> None:
        self.items = items
        self.rows = len(items)
        self.polls = 0

    def wait(self, timeout: float | None = None) -> bool:
        self.polls += 1
        return self.polls > self.rows

    def finished_figures(self) -> LiveFigures:
        return LiveFigures(succeeded=min(self.polls, self.rows))

    def outputs(self, expired: bool = False, earlier: object = ()) -> list[OutputRow]:
        return [completed(item.index) for item in self.items if isinstance(item, Row)]

    def abort(self) -> None:
        pass


class RecordingProgress:
    def __init__(self) -> None:
        self.settled = 0
        self.seen: list[int] = []  # rows done at each report: settled + running

    def update(self, finished: list[OutputRow], running: LiveFigures) -> None:
        self.settled += len(finished)
        self.seen.append(self.settled + running.rows)


def test_the_row_loop_reports_rows_finished_inside_a_window_before_the_window_ends(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(row_window, "start_run", lambda hosted, items, *args, **kwargs: ScriptedRun(items))
    progress = RecordingProgress()
    outputs = row_window.run_rows(SimpleNamespace(), [row(index) for index in range(4)], poll_s=0,
                                  window_rows=4, progress=progress)
    assert outputs is not None and len(outputs) == 4
    assert progress.seen == [1, 2, 3, 4, 4]  # one more row at each poll, then the window's outcomes
    assert progress.settled == 4
