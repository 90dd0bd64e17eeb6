"""`run_rows`: a shard's rows through the engine a window at a time, never the whole shard at once.

Rows are read lazily and cut into windows of `window_rows` rows (or `WINDOW_PROMPT_BYTES` of prompt
text, whichever comes first). At most `WINDOWS_IN_FLIGHT` windows are in the engine: while one runs
the next waits in the engine's queue (the engine never drains between windows), and the window after
is read only when the oldest finishes. So a shard holds at most two windows of input rows, however
many rows it has or however long its lines are. Outcomes come back in input order; identical
deterministic rows run once across windows as inside one (`PreparedBatch`'s shared `known`); cancel
and the job's deadline abort what is in flight, and the rows not read yet come back `expired` at a
deadline. A `progress` hears of rows as they finish (worker/shards/shard_progress.py): each window's
outcomes when it is done, and at every poll the rows already finished inside the windows in flight.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from bulkinfer.jobs.formats.output import OutputRow, expired_row
from bulkinfer.jobs.formats.rows import Row, RowError
from bulkinfer.jobs.state.live_progress import LiveFigures, total
from bulkinfer.worker.hosts.embed_rows import EmbedRun
from bulkinfer.worker.hosts.engine_rows import EngineRun
from bulkinfer.worker.images.fetcher import ImageFetcher

if TYPE_CHECKING:
    from bulkinfer.worker.hosts.model_hosts import HostedModel

DEFAULT_WINDOW_ROWS = 1024  # settings.shard_window_rows
WINDOW_PROMPT_BYTES = 64 << 20
WINDOWS_IN_FLIGHT = 2


@dataclass
class WindowStats:
    """What a run held: rows read whose outcome was not known yet, at most (for tests and logs)."""

    rows_read: int = 0
    rows_done: int = 0
    peak_rows_held: int = 0

    def note(self) -> None:
        self.peak_rows_held = max(self.peak_rows_held, self.rows_read - self.rows_done)


class RowProgress(Protocol):
    def update(self, finished: Sequence[OutputRow], running: LiveFigures) -> None:
        """Adds rows whose outcome is now final (`finished`) and replaces the provisional figures of
        the rows finished inside the windows still in the engine (`running`), in one step."""


class _NoProgress:
    def update(self, finished: Sequence[OutputRow], running: LiveFigures) -> None:
        pass


def run_rows(hosted: HostedModel, items: Iterable[Row | RowError], priority: int = 0, *,
             should_stop: Callable[[], bool] = lambda: False, poll_s: float = 0.5,
             deduplicate: bool = True, expires_in_s: float | None = None,
             window_rows: int = DEFAULT_WINDOW_ROWS, cache_salt: str | None = None,
             stats: WindowStats | None = None, progress: RowProgress | None = None,
             images: ImageFetcher | None = None) -> list[OutputRow] | None:
    """Every row's outcome in input order, or None if `should_stop()` (checked every `poll_s`
    while rows run, and as each window finishes) said to stop: the rows in the engine are then
    aborted and no more are read.
    When `expires_in_s` seconds pass first (the job's deadline), the rows not finished by then come
    back `expired`, the finished ones as they are. `cache_salt`: the rows share prefix-cache blocks
    only with requests of the same salt (worker/hosts/prefix_cache_salt.py). `images`: reads the
    rows' images (worker/images/)."""
    stats = stats or WindowStats()
    progress = progress or _NoProgress()
    source = _windows(items, window_rows, stats)
    if expires_in_s is not None and expires_in_s <= 0:
        expired = [expired_row(item) for window in source for item in window]
        progress.update(expired, LiveFigures())
        return expired
    deadline = None if expires_in_s is None else time.monotonic() + expires_in_s
    known: dict[bytes, int] = {}
    outputs: list[OutputRow] = []
    in_flight: deque[EngineRun | EmbedRun] = deque()
    submitted = 0
    try:
        while True:
            while len(in_flight) < WINDOWS_IN_FLIGHT and (window := next(source, None)) is not None:
                in_flight.append(start_run(hosted, window, priority, deduplicate, known, offset=submitted,
                                           cache_salt=cache_salt, images=images))
                submitted += len(window)
            if not in_flight:
                return outputs
            oldest = in_flight[0]
            while not oldest.wait(poll_s if deadline is None else
                                  max(0.0, min(poll_s, deadline - time.monotonic()))):
                if should_stop():
                    _abort(in_flight)
                    return None
                if deadline is not None and time.monotonic() >= deadline:
                    _abort(in_flight)
                    ended = len(outputs)
                    for run in in_flight:
                        outputs += run.outputs(expired=True, earlier=outputs)
                    in_flight.clear()
                    outputs += [expired_row(item) for window in source for item in window]
                    progress.update(outputs[ended:], LiveFigures())
                    return outputs
                progress.update((), total(run.finished_figures() for run in in_flight))
            in_flight.popleft()
            done = oldest.outputs(earlier=outputs)
            outputs += done
            stats.rows_done += oldest.rows
            progress.update(done, total(run.finished_figures() for run in in_flight))
            if should_stop():  # also between windows: a shard of quick windows may never wait a poll
                _abort(in_flight)
                return None
    except BaseException:  # a read or engine failure, or the worker stopping: nothing left running
        _abort(in_flight)
        raise


def start_run(hosted: HostedModel, items: list[Row | RowError], priority: int = 0, deduplicate: bool = True,
              known: dict[bytes, int] | None = None, offset: int = 0,
              cache_salt: str | None = None, images: ImageFetcher | None = None) -> EngineRun | EmbedRun:
    """The rows submitted to the model's host: an `EmbedRun` on an embedding model, else an `EngineRun`."""
    if hosted.is_embedding:
        return EmbedRun(hosted, items, priority, deduplicate, known, offset, cache_salt=cache_salt)
    return EngineRun(hosted, items, priority, deduplicate, known, offset, cache_salt=cache_salt,
                     images=images)


def _abort(runs: Iterable[EngineRun | EmbedRun]) -> None:
    for run in runs:
        run.abort()


def _windows(items: Iterable[Row | RowError], window_rows: int,
             stats: WindowStats) -> Iterator[list[Row | RowError]]:
    window: list[Row | RowError] = []
    window_bytes = 0
    for item in items:
        window.append(item)
        stats.rows_read += 1
        stats.note()
        window_bytes += _prompt_bytes(item)
        if len(window) >= window_rows or window_bytes >= WINDOW_PROMPT_BYTES:
            yield window
            window, window_bytes = [], 0
    if window:
        yield window


def _prompt_bytes(item: Row | RowError) -> int:
    if isinstance(item, RowError):
        return 0
    if item.embed is not None:  # texts, or token ids (4 bytes each, about what they hold in text)
        return sum(len(value) if isinstance(value, str) else 4 * len(value) for value in item.embed.inputs)
    if item.prompt is not None:
        return len(item.prompt)
    return sum(len(str(message.get("content") or "")) for message in item.messages or ())
