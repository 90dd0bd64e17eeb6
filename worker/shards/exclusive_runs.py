"""Engine runs in this worker process: together (the usual way), or one alone.

A shard's task threads share the process's engine, so a row that kills the process (SIGKILL, out
of memory, a native crash) takes every shard running beside it down too, and nothing tells which
one was at fault. A shard that has crashed its worker before (worker/shards/shard_crashes.py) runs its
pieces `alone()`: no other shard's rows are in the process meanwhile, so a crash then is that
piece's own, and the shards that would have run beside it are not killed with it. Waiting
`alone()` runs hold back new `together()` runs, so an alone run waits at most for the runs
already going.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class ExclusiveRuns:
    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._together = 0  # runs going side by side
        self._alone = False  # an alone run is going
        self._alone_waiting = 0

    @contextmanager
    def together(self) -> Iterator[None]:
        with self._changed:
            self._changed.wait_for(lambda: not self._alone and not self._alone_waiting)
            self._together += 1
        try:
            yield
        finally:
            with self._changed:
                self._together -= 1
                self._changed.notify_all()

    @contextmanager
    def alone(self, give_up: Callable[[], bool], poll_s: float = 0.5) -> Iterator[bool]:
        """Yields True once no other run is going (and none starts until the block ends), or False
        as soon as `give_up()` says so while waiting (nothing held then)."""
        holding = False
        with self._changed:
            self._alone_waiting += 1
            try:
                while self._alone or self._together:
                    if give_up():
                        break
                    self._changed.wait(poll_s)
                else:
                    self._alone = holding = True
            finally:
                self._alone_waiting -= 1
                self._changed.notify_all()  # together() runs held back by this wait may go on
        if not holding:
            yield False
            return
        try:
            yield True
        finally:
            with self._changed:
                self._alone = False
                self._changed.notify_all()


# The process's engines are shared by all its task threads: one gate for all of them.
ENGINE_RUNS = ExclusiveRuns()
