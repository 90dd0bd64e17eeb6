"""One tick of a schedule: list its input, submit one job per new (key, ETag), remember it.

Both sides run it: the workers' ticker for due schedules (worker/process/schedule_ticker.py) and the API's
`POST /schedules/{id}/tick`. Each passes its own way to send `bulkinfer.plan_job`; the job itself
is created exactly as `POST /jobs` creates it (`JobRepository.create`, then plan while queued).

A tick respects the tenant's `max_jobs_in_flight`: jobs a schedule submits are the schedule
tenant's jobs, counted like any other. Once the tenant has that many queued or running, the tick
stops and the objects left are deferred (not marked submitted), so a later tick submits them once
jobs have ended; the tick records why (`last_error`, and the report's `deferred` count).

No tick can submit an object twice: the job's idempotency key (hence its id) derives from
(schedule, key, ETag), and `create` returns the existing job for it. The Redis record of what was
submitted only saves the work of asking again. A changed object (new ETag) is new input: a new job.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime

from pydantic import ValidationError
from redis.exceptions import LockError

from bulkinfer.jobs.errors import InputError
from bulkinfer.jobs.formats.batch_task import SUBMIT_SCAN_BYTES, task_given, with_task_of_lines
from bulkinfer.jobs.formats.detect import resolve_spec
from bulkinfer.jobs.limits import in_flight_message, jobs_in_flight
from bulkinfer.jobs.object_store.base import ObjectInfo, ObjectStore
from bulkinfer.jobs.object_store.factory import store_for_uri
from bulkinfer.jobs.scheduling.schedules import (
    Schedule,
    ScheduleRepository,
    SubmittedObject,
    fingerprint,
    matches,
    split_input,
)
from bulkinfer.jobs.state.repository import IdempotencyConflict, JobRepository
from bulkinfer.jobs.state.status import JobState

logger = logging.getLogger(__name__)

EnqueuePlan = Callable[[str], None]  # job_id → send bulkinfer.plan_job
# A prefix that suddenly holds thousands of files is submitted over several ticks.
MAX_JOBS_PER_TICK = 100


@dataclass
class TickResult:
    schedule_id: str
    submitted: list[SubmittedObject] = field(default_factory=list)  # new this tick
    error: str | None = None
    deferred: int = 0  # new objects left for a later tick: the tenant is at max_jobs_in_flight


def input_objects(schedule: Schedule,
                  endpoint_url: str | None = None) -> tuple[ObjectStore, list[ObjectInfo]]:
    """The schedule's input objects in key order: under the prefix, matching the glob if any.
    Folder markers and empty objects (often placeholders still being written) are left out.
    """
    base, pattern = split_input(schedule.input_prefix)
    store, key = store_for_uri(base, endpoint_url=endpoint_url)
    objects = [info for info in store.list(key)
               if info.size > 0 and not info.key.endswith("/") and matches(pattern, info.key)]
    return store, objects


def submit_object(jobs: JobRepository, schedule: Schedule, store: ObjectStore, info: ObjectInfo,
                  enqueue_plan: EnqueuePlan) -> str:
    """Create (or find again) the job for one object, plan it while it is queued; its id."""
    spec = schedule.job_spec(store.uri(info.key), info.key, info.etag)
    try:
        spec = with_task_of_lines(resolve_spec(spec, store, info.key), task_given(spec), store, info.key,
                                  SUBMIT_SCAN_BYTES)
    except (ValidationError, InputError) as error:
        # Stored unresolved: the planner resolves it again and fails the job with this reason.
        logger.warning("schedule %s: %s: %s", schedule.id, info.key, error)
    try:
        status = jobs.create(spec)
    except IdempotencyConflict as conflict:  # resolved differently on an earlier tick: that job stands
        status = jobs.get(conflict.job_id)
    if status.state == JobState.QUEUED:
        enqueue_plan(status.job_id)
    return status.job_id


def tick_schedule(schedules: ScheduleRepository, jobs: JobRepository, schedule: Schedule,
                  enqueue_plan: EnqueuePlan, *, endpoint_url: str | None = None,
                  now: datetime | None = None, limit: int = MAX_JOBS_PER_TICK,
                  max_jobs_in_flight: int | None = None) -> TickResult:
    """Submit the schedule's new objects (at most `limit`, and only while the schedule's tenant has
    fewer than `max_jobs_in_flight` jobs in flight), one tick of a schedule at a time.
    Failures are recorded on the schedule (`runtime.last_error`) and returned, with whatever was
    submitted before them.
    """
    now = now or datetime.now(UTC)
    result = TickResult(schedule.id)
    lock = schedules.lock(schedule.id)
    if not lock.acquire():  # waited a minute for another tick of this schedule
        result.error = "another tick of this schedule is still running; try again"
        return result
    try:
        _submit_new(schedules, jobs, schedule, enqueue_plan, endpoint_url, now, limit, max_jobs_in_flight,
                    result)
    except Exception as error:  # noqa: BLE001 - recorded on the schedule; the next tick tries again
        result.error = f"{type(error).__name__}: {error}"
        logger.warning("schedule %s tick failed: %s", schedule.id, result.error)
    try:
        schedules.record_tick(schedule.id, now, result.error)
    finally:
        with suppress(LockError):  # expired during a very long tick: nothing left to release
            lock.release()
    if result.submitted:
        logger.info("schedule %s: %d job(s) submitted", schedule.id, len(result.submitted))
    return result


def _submit_new(schedules: ScheduleRepository, jobs: JobRepository, schedule: Schedule,
                enqueue_plan: EnqueuePlan, endpoint_url: str | None, now: datetime, limit: int,
                max_jobs_in_flight: int | None, result: TickResult) -> None:
    store, objects = input_objects(schedule, endpoint_url)
    seen = schedules.seen(schedule.id)
    new = [info for info in objects if fingerprint(info.key, info.etag) not in seen]
    room = len(new) if max_jobs_in_flight is None or not new else \
        max(0, max_jobs_in_flight - jobs_in_flight(jobs, schedule.tenant, max_jobs_in_flight))
    if room < min(len(new), limit):
        result.deferred = len(new) - room
        result.error = (f"{result.deferred} new object(s) deferred to a later tick: "
                        f"{in_flight_message(schedule.tenant, max_jobs_in_flight or 0)}")
        logger.info("schedule %s: %s", schedule.id, result.error)
    for info in new[:room]:
        if len(result.submitted) >= limit:
            return
        job_id = submit_object(jobs, schedule, store, info, enqueue_plan)
        record = SubmittedObject(key=info.key, etag=info.etag, job_id=job_id, submitted_at=now)
        schedules.mark_submitted(schedule.id, record)  # after the plan is sent: a crash before resends
        result.submitted.append(record)


def is_due(schedules: ScheduleRepository, schedule: Schedule, now: datetime) -> bool:
    if schedule.paused:
        return False
    next_at = schedules.runtime(schedule).next_tick_at
    return next_at is not None and next_at <= now


def tick_due(schedules: ScheduleRepository, jobs: JobRepository, enqueue_plan: EnqueuePlan, *,
             endpoint_url: str | None = None, now: datetime | None = None,
             max_jobs_in_flight: int | None = None) -> list[TickResult]:
    """Tick every schedule whose cron has fired since its last tick (missed fires count once)."""
    now = now or datetime.now(UTC)
    results = []
    for schedule in schedules.list():
        try:  # one schedule's fault (whoever's it is) never stops the others' ticks
            due = is_due(schedules, schedule, now)
        except Exception:
            logger.exception("schedule %s: cannot tell whether it is due; skipped", schedule.id)
            continue
        if due:
            results.append(tick_schedule(schedules, jobs, schedule, enqueue_plan, endpoint_url=endpoint_url,
                                         now=now, max_jobs_in_flight=max_jobs_in_flight))
    return results
