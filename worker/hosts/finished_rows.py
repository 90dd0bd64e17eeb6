"""The rows of a window still in the engine, counted as their requests finish.

A window's outcomes are built once every row of it is done (`EngineRun.outputs`); a window can be
a thousand rows, a whole one-shard job. So that a job's counts move as rows finish, each run also
counts its rows as their futures complete: a row that could not run at once, a request when it is
done (with the rows that copy it, deduplicated), each once. These figures are provisional (the
window's outcomes decide, e.g. an output that is not the JSON its row asked for fails it) and the
shard's commit replaces them all (jobs/state/live_progress.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from bulkinfer.jobs.state.live_progress import LiveFigures


class FinishedRows:
    """`groups`: per runnable row, the futures of its requests and how many rows copy it; `figures_of`:
    the row's own figures from its requests' results; `failed_at_once`: rows that never ran."""

    def __init__(self, groups: Sequence[tuple[Sequence[Future], int]],
                 figures_of: Callable[[list[Any]], LiveFigures], failed_at_once: int = 0) -> None:
        self._groups = groups
        self._figures_of = figures_of
        self._waiting = list(range(len(groups)))
        self._done = LiveFigures(failed=failed_at_once)

    def figures(self) -> LiveFigures:
        """The rows finished so far (each future looked at until it is done, then never again)."""
        waiting = []
        for index in self._waiting:
            futures, copies = self._groups[index]
            if not all(future.done() for future in futures):
                waiting.append(index)
                continue
            if any(future.exception() is not None for future in futures):
                continue  # the model died: `outputs()` raises it
            row = self._figures_of([future.result() for future in futures])
            self._done += row + LiveFigures(succeeded=row.succeeded * copies, failed=row.failed * copies,
                                            deduplicated=copies)
        self._waiting = waiting
        return self._done


def copies_of(copies: Sequence[tuple[int, Any, int]]) -> dict[int, int]:
    """How many rows copy each position, from a batch's `(position, row, source position)` list."""
    counts: dict[int, int] = {}
    for _position, _row, source in copies:
        counts[source] = counts.get(source, 0) + 1
    return counts
