"""The progress line of `bulkinfer run` on a terminal: rows done, rows/s and tokens/s of this run."""

from __future__ import annotations

import time
from collections.abc import Sequence
from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from bulkinfer.jobs.formats.output import OutputRow


class RunProgress:
    """Shown only on a terminal (stderr); rates count this run's rows, not those skipped on resume."""

    def __init__(self, total: int, done: int = 0, *, enabled: bool = True) -> None:
        console = Console(stderr=True)
        self._progress = Progress(TextColumn("rows"), BarColumn(), MofNCompleteColumn(),
                                  TextColumn("{task.fields[rates]}"), TimeElapsedColumn(), console=console,
                                  disable=not (enabled and console.is_terminal))
        self._task = self._progress.add_task("rows", total=total, completed=done, rates="")
        self._started = time.monotonic()
        self.rows = self.failed = self.tokens = self.completion_tokens = 0
        self.prompt_formats: set[str] = set()  # how its prompts were rendered (OutputRow.prompt_format)

    def advance(self, rows: Sequence[OutputRow]) -> None:
        self.rows += len(rows)
        self.failed += sum(row.failed for row in rows)
        self.completion_tokens += sum(row.completion_tokens or 0 for row in rows)
        self.prompt_formats.update(row.prompt_format for row in rows if row.prompt_format)
        self.tokens += sum((row.prompt_tokens or 0) + (row.completion_tokens or 0) for row in rows)
        seconds = max(time.monotonic() - self._started, 1e-9)
        task = self._progress.tasks[0]
        total = max(task.total or 0, task.completed + len(rows))  # the row count may be an estimate
        rates = (f"{self.rows / seconds:.1f} rows/s, {self.completion_tokens / seconds:.0f} output tok/s, "
                 f"{self.tokens / seconds:.0f} tok/s" + (f", {self.failed} failed" if self.failed else ""))
        self._progress.update(self._task, advance=len(rows), total=total, rates=rates)

    def __enter__(self) -> RunProgress:
        self._progress.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if kind is None:  # finished: the bar shows every row
            task = self._progress.tasks[0]
            self._progress.update(self._task, total=task.completed)
        self._progress.stop()
