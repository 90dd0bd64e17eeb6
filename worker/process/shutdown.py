"""A worker told to stop (SIGTERM: a pod deleted, a scale-in, `bulkinfer up` ending) hands its
running shards back instead of making the pod's grace period wait for them to finish.

Celery's warm shutdown stops taking tasks and waits for the running ones. `begin()` (on Celery's
`worker_shutting_down`) sets the flag every running shard polls with its cancel check (every
`CANCEL_POLL_S`): the shard aborts its rows in the engine, writes nothing, releases its lease and
is sent again to its queue, where another worker (or this one, restarted) runs it from the start.
So a stop takes a second or two, whatever the shards' length, and loses no row.
"""

from __future__ import annotations

import threading

_stopping = threading.Event()


class ShardHandedBack(Exception):  # noqa: N818 - not an error: the shard goes back to its queue
    """The worker is stopping: this shard's run ended without writing, to be run again elsewhere."""


def begin() -> None:
    _stopping.set()


def stopping() -> bool:
    return _stopping.is_set()


def reset() -> None:
    """For tests that stop and start workers in one process."""
    _stopping.clear()
