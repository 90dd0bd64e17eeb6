"""A worker whose broker consumer has stalled stops, so its supervisor starts a fresh one.

Seen under a Redis out-of-memory spell (`bench faults`, redis-oom): storing a task's result was
refused, the message was never acknowledged, kombu kept it counted as in hand, and with one message
prefetched per thread the consumer never fetched again: tasks waited in the queue while the worker
idled, for good. Nothing in Celery notices. Tasks no longer store results (celery_app.py), which
removed that cause; any other that leaves a message in hand ends the same way, so every worker
still watches itself: when messages have waited in its queues for `STALL_S` while it had a
free thread and received nothing, it logs why and sends itself SIGTERM (a warm shutdown: running
shards are handed back); the process manager, or `bench faults`, starts another.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

STALL_S = 60.0  # a healthy consumer takes a waiting message within a second
CHECK_EVERY_S = 5.0


@dataclass
class ConsumerActivity:
    """What the worker's task signals report: when a message last arrived, and tasks running now."""

    last_received: float = field(default_factory=time.monotonic)
    running: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def received(self) -> None:
        self.last_received = time.monotonic()

    def started(self) -> None:
        with self._lock:
            self.running += 1

    def finished(self) -> None:
        with self._lock:
            self.running = max(0, self.running - 1)


def stalled(activity: ConsumerActivity, concurrency: int, waiting: int, waiting_since: float | None,
            now: float, stall_s: float = STALL_S) -> bool:
    """Whether the consumer has stalled: messages waiting (for `stall_s` at least) while a thread was
    free, and none received in that time."""
    if waiting <= 0 or waiting_since is None or activity.running >= concurrency:
        return False
    quiet_since = max(activity.last_received, waiting_since)
    return now - quiet_since >= stall_s


def watch(activity: ConsumerActivity, queues: Sequence[str], concurrency: int,
          waiting_count: Callable[[str], int], stop: threading.Event,
          on_stall: Callable[[str], None] | None = None, every_s: float = CHECK_EVERY_S,
          stall_s: float = STALL_S) -> None:
    """Check every `every_s` (until `stop`); on a stall, `on_stall(reason)` (default: SIGTERM to this
    process) once."""
    waiting_since: float | None = None
    while not stop.wait(every_s):
        try:
            waiting = sum(waiting_count(queue) for queue in queues)
        except Exception:  # noqa: BLE001 - the broker down: that is the reaper's and the retries' to ride out
            waiting_since = None
            continue
        now = time.monotonic()
        if waiting <= 0 or activity.running >= concurrency:
            waiting_since = None
            continue
        waiting_since = waiting_since if waiting_since is not None else now
        if stalled(activity, concurrency, waiting, waiting_since, now, stall_s):
            reason = (f"{waiting} message(s) waited in {', '.join(queues)} for {now - waiting_since:.0f}s "
                      f"with a thread free and none received: the broker consumer has stalled")
            (on_stall or _stop_worker)(reason)
            return


EXIT_AFTER_S = 120.0  # a warm shutdown that has not ended by then is cut short


def _stop_worker(reason: str) -> None:
    logger.error("%s; stopping this worker so that a fresh one takes over", reason)
    os.kill(os.getpid(), signal.SIGTERM)
    # The warm shutdown hands running shards back; should it hang on the stalled connection, exit anyway.
    threading.Timer(EXIT_AFTER_S, os._exit, args=(3,)).start()
