"""Fault injection for tests and `bulkinfer bench faults`: a row that really kills its worker.

Off unless the worker process's environment sets `BULKINFER_FAULT_INJECT_KILL_MARKER` to a string
of at least `MIN_MARKER_CHARS` characters; then a worker about to hand the engine a row whose prompt
(or chat messages) contains that string sends its own process SIGKILL, as an out-of-memory kill
would: no exception, no `finally`, no warm shutdown. It is not a setting (no config file, flag or
`Settings.to_env` carries it), so only whoever starts the worker process can turn it on; a tenant's
row alone can never trigger it.
"""

from __future__ import annotations

import json
import logging
import os
import signal
from collections.abc import Iterable, Iterator, Sequence

from bulkinfer.jobs.formats.rows import Row, RowError

KILL_MARKER_ENV = "BULKINFER_FAULT_INJECT_KILL_MARKER"
MIN_MARKER_CHARS = 16  # so that no ordinary text can match by accident

logger = logging.getLogger(__name__)
_warned = False


def kill_marker() -> str | None:
    """The marker when fault injection is on in this process, else None."""
    global _warned
    marker = os.environ.get(KILL_MARKER_ENV, "")
    if len(marker) < MIN_MARKER_CHARS:
        return None
    if not _warned:
        _warned = True
        logger.warning("fault injection is ON (%s): a row containing the marker kills this worker",
                       KILL_MARKER_ENV)
    return marker


def row_text(item: Row | RowError) -> str:
    if isinstance(item, RowError):
        return ""
    if item.messages is not None:
        return json.dumps(item.messages, ensure_ascii=False)
    return item.prompt or ""


def kill_if_marked(items: Sequence[Row | RowError]) -> None:
    """SIGKILL this process when fault injection is on and a row carries the marker."""
    for _ in killing_on_marker(items):
        pass


def killing_on_marker(items: Iterable[Row | RowError]) -> Iterator[Row | RowError]:
    """The rows as they are read; SIGKILL this process, when fault injection is on, as the engine
    is about to get a row that carries the marker (rows reach it a window at a time)."""
    marker = kill_marker()
    for item in items:
        if marker is not None and marker in row_text(item):
            logger.warning("fault injection: row %s carries the kill marker; killing this worker (pid %d)",
                           item.row_id, os.getpid())
            for handler in logging.getLogger().handlers:
                handler.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        yield item
