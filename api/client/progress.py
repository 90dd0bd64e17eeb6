"""A progress bar for `jobs.wait`: rows done / total and output tokens per second, on stderr, shown
only when stderr is a terminal (a log file or a pipe gets nothing)."""

from __future__ import annotations

import sys
import time
from typing import IO, Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from bulkinfer.jobs.state.status import JobStatus


def wants_progress(progress: bool, stream: IO[str] | None = None) -> bool:
    stream = stream or sys.stderr
    return progress and hasattr(stream, "isatty") and stream.isatty()


class JobProgress:
    """Feed it each polled status; it redraws one line. `close()` leaves the last state on screen."""

    def __init__(self, console: Console | None = None) -> None:
        self._progress = Progress(
            TextColumn("{task.description}"), BarColumn(),
            TextColumn("{task.fields[rows]}"),
            TextColumn("{task.fields[failed]}"), TextColumn("{task.fields[speed]}"), TimeElapsedColumn(),
            console=console or Console(stderr=True), transient=False)
        self._task: TaskID | None = None
        self._first: tuple[float, int] | None = None  # (time, completion tokens) at the first poll

    def update(self, status: JobStatus) -> None:
        now = time.monotonic()
        if self._first is None:
            self._first = (now, status.usage.completion)
            self._progress.start()
        done = status.rows.succeeded + status.rows.failed
        elapsed = now - self._first[0]
        tokens = status.usage.completion - self._first[1]
        speed = f"{tokens / elapsed:,.0f} tok/s" if elapsed > 0 and tokens > 0 else ""
        failed = f"({status.rows.failed} failed)" if status.rows.failed else ""
        total = max(status.rows.total, done)  # 0 until the job is planned
        fields: dict[str, Any] = {"description": f"{status.job_id} {status.state.value}", "completed": done,
                  "total": total or None, "rows": f"{done}/{total or '?'} rows", "failed": failed,
                  "speed": speed}
        if self._task is None:
            self._task = self._progress.add_task(**fields)
        else:
            self._progress.update(self._task, **fields)

    def close(self) -> None:
        if self._first is not None:
            self._progress.stop()
