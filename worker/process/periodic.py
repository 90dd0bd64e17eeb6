"""One background loop for the work every worker runs on a period (the shard reaper, the schedule
ticker): a Redis lock taken each period with `SET NX PX`, held until it expires, so at most one
worker ticks per period however many run; a failing tick (Redis or the store down for a moment) is
logged and the next period tries again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from bulkinfer.jobs.names import periodic_lock_key
from bulkinfer.jobs.settings import Settings
from bulkinfer.worker.process.context import WorkerContext

logger = logging.getLogger(__name__)


def start_periodic(name: str, settings: Settings, every_s: float,
                   tick: Callable[[WorkerContext], object]) -> threading.Event:
    """Run `tick` every `every_s` seconds in a daemon thread named `name`, on one worker at a time;
    set the returned event to stop it. The thread has its own context: the process's shared one
    is never built here (this may be a prefork parent)."""
    stop = threading.Event()
    threading.Thread(target=_loop, args=(name, stop, WorkerContext(settings), every_s, tick), name=name,
                     daemon=True).start()
    return stop


def _loop(name: str, stop: threading.Event, context: WorkerContext, every_s: float,
          tick: Callable[[WorkerContext], object]) -> None:
    lock = periodic_lock_key(context.repository.namespace, name)
    while not stop.wait(every_s):
        try:
            if context.repository.redis.set(lock, 1, nx=True, px=max(int(every_s * 1000) - 100, 100)):
                tick(context)
        except Exception:  # noqa: BLE001 - Redis or the store down for a moment: try next period
            logger.exception("%s tick failed", name)
