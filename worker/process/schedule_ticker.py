"""The schedule ticker: every worker runs it; one tick at a time across workers (a Redis lock).

Each tick submits jobs for the schedules whose cron fired since their last tick
(`bulkinfer.jobs.scheduling.schedule_tick.tick_due`): no extra beat process to deploy, and a restarted or
duplicated ticker cannot submit a job twice (job ids derive from schedule, object key and ETag).
"""

from __future__ import annotations

import threading

from bulkinfer.jobs.scheduling.schedule_tick import TickResult, tick_due
from bulkinfer.jobs.scheduling.schedules import ScheduleRepository
from bulkinfer.jobs.settings import Settings
from bulkinfer.worker.process.context import WorkerContext
from bulkinfer.worker.process.periodic import start_periodic

DEFAULT_TICK_S = 15.0


def tick_s(settings: Settings) -> float:
    """Seconds between ticker passes: `BULKINFER_SCHEDULE_TICK_S`, default 15 s (cron fires are
    minutes apart; a 6-field cron with seconds needs a shorter period to fire on time).
    """
    return settings.schedule_tick_s or DEFAULT_TICK_S


def tick_once(context: WorkerContext) -> list[TickResult]:
    """One pass: tick every due schedule."""
    from bulkinfer.worker.process.tasks import send_plan

    repository = context.repository
    return tick_due(ScheduleRepository.beside(repository), repository, send_plan,
                    endpoint_url=context.settings.s3_endpoint_url,
                    max_jobs_in_flight=context.settings.max_jobs_in_flight)


def start_ticker(settings: Settings) -> threading.Event:
    """Start the ticker thread (daemon); set the returned event to stop it."""
    return start_periodic("schedule-ticker", settings, tick_s(settings), tick_once)
