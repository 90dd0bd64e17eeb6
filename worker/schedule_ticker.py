"""The schedule ticker: every worker runs it; one tick at a time across workers (a Redis lock).

Each tick submits jobs for the schedules whose cron fired since their last tick
(`jobs.schedule_tick.tick_due`): no extra beat process to deploy, and a restarted or duplicated
ticker cannot submit a job twice (job ids derive from schedule, object key and ETag).
"""

from __future__ import annotations

import logging
import threading

from jobs.schedule_tick import TickResult, tick_due
from jobs.schedules import ScheduleRepository
from jobs.settings import Settings
from worker.context import WorkerContext

logger = logging.getLogger(__name__)

DEFAULT_TICK_S = 15.0


def tick_s(settings: Settings) -> float:
    """Seconds between ticker passes: `BULKINFER_SCHEDULE_TICK_S`, default 15 s (cron fires are
    minutes apart; a 6-field cron with seconds needs a shorter period to fire on time).
    """
    return settings.schedule_tick_s or DEFAULT_TICK_S


def tick_once(context: WorkerContext) -> list[TickResult]:
    """One pass: tick every due schedule."""
    from worker.tasks import send_plan

    repository = context.repository
    return tick_due(ScheduleRepository.beside(repository), repository, send_plan,
                    endpoint_url=context.settings.s3_endpoint_url)


def _loop(stop: threading.Event) -> None:
    # Its own context: never build the process's shared one here (it may be a prefork parent).
    context = WorkerContext(Settings.from_env())
    every_s = tick_s(context.settings)
    lock = f"{context.repository.namespace}:schedule-ticker:lock"
    while not stop.wait(every_s):
        try:
            # Held until it expires: at most one pass per period across all workers.
            if context.repository.redis.set(lock, 1, nx=True, px=max(int(every_s * 1000) - 100, 100)):
                tick_once(context)
        except Exception:  # noqa: BLE001 - Redis or the store down for a moment: try next period
            logger.exception("schedule ticker pass failed")


def start_ticker() -> threading.Event:
    """Start the ticker thread (daemon); set the returned event to stop it."""
    stop = threading.Event()
    threading.Thread(target=_loop, args=(stop,), name="schedule-ticker", daemon=True).start()
    return stop
