"""The reaper: re-sends the steps of jobs whose worker died mid-run, instead of waiting for the broker.

A worker killed mid-task leaves its message unacknowledged in Redis, which would deliver it again
only after the 12 h visibility timeout. Every worker runs a reaper thread; each tick (one worker at
a time, via a short Redis lock) it looks at the jobs that have not ended:

- shards of `running` jobs that were started (a run took the lease), have no shard result and no
  live lease (the holder died, so its lease lapsed): `run_shard` again once seen so for two lease
  TTLs across ticks, and one copy at a time (worker/shards/shard_resend.py); a shard never started (still
  waiting in its queue) or waiting for a retry of its run is never re-sent;
- `queued` jobs (the API died between creating and queueing one, or its planner died) and `running`
  jobs whose planner died before sending every shard: `plan_job` again;
- `running` jobs with every shard counted, and `finalizing` ones (the finalizer died): `finalize_job`
  again;
- a model queue whose fair queue holds more waiting shards than the broker holds tickets for it (a
  ticket prefetched by a worker that was then killed stays unacknowledged for the visibility timeout,
  and its shard, never started, would wait for it): the missing tickets, once seen missing for two
  lease TTLs. A ticket too many finds nothing waiting and ends.

A plan or finalize is re-sent only when no run holds its lease and the reaper has seen it due for
two lease TTLs (its message may just be waiting behind busy workers), then at most once per two
TTLs. All of it is safe: leases, write-once results and plans, and idempotent transitions make
every step safe to run twice. So a job whose worker died ends within a few lease TTLs plus a tick.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import redis

from bulkinfer.jobs.fair_queue import FairQueue
from bulkinfer.jobs.layout import JobLayout
from bulkinfer.jobs.names import (
    dispatched_key,
    orphan_sweep_key,
    shard_lease_key,
    shards_started_key,
    step_due_key,
    step_lease_key,
)
from bulkinfer.jobs.orphan_uploads import sweep_orphan_uploads
from bulkinfer.jobs.settings import Settings
from bulkinfer.jobs.state.repository import JobRepository
from bulkinfer.jobs.state.status import JobState
from bulkinfer.worker.process import metrics
from bulkinfer.worker.process.context import WorkerContext
from bulkinfer.worker.process.periodic import start_periodic
from bulkinfer.worker.shards import shard_resend
from bulkinfer.worker.shards.deadline_sweep import expire_due
from bulkinfer.worker.shards.shard_runner import committed_result, count_shard

logger = logging.getLogger(__name__)

SendShard = Callable[[str, int, str], None]  # (job_id, shard_index, queue)
SendJobStep = Callable[[str], None]  # (job_id)
CountTickets = Callable[[str], int]  # (queue) -> messages waiting in the broker
SendTicket = Callable[[str], None]  # (queue)
DUE_TTL_S = 24 * 3600
ORPHAN_SWEEP_S = 600.0


def reap_once(context: WorkerContext, send_shard: SendShard, ttl_s: float,
              send_finalize: SendJobStep = lambda _job_id: None,
              count_waiting: CountTickets | None = None) -> list[tuple[str, int]]:
    """One pass over the running jobs; returns the (job, shard) pairs it re-sent. A started shard
    with a result but no live lease whose run died before counting it is counted here (and the
    job finalized when that was the last one). `count_waiting`: messages in a queue's broker list
    (default: the broker's count)."""
    repository = context.repository
    client, namespace = repository.redis, repository.namespace
    resent: list[tuple[str, int]] = []
    grace_s, gap_s = 2 * ttl_s, max(3 * context.settings.reaper_tick, ttl_s)
    waiting: dict[str, int] = {}

    def queue_is_empty(queue: str) -> bool:
        if queue not in waiting:
            from bulkinfer.worker.process.tasks import broker_ticket_count

            waiting[queue] = (count_waiting or broker_ticket_count)(queue)
        return waiting[queue] == 0

    cursor: str | None = None
    while True:
        jobs, cursor = repository.list(JobState.RUNNING, cursor=cursor, limit=100)
        for job in jobs:
            started_set = shards_started_key(namespace, job.job_id)
            started = sorted(int(index) for index in client.smembers(started_set))
            if not started:
                continue
            try:
                layout = repository.layout(job.job_id)
                counted = {int(i) for i in client.smembers(repository.counters(job.job_id).counted_key)}
                queue = None
                alive: list[int] = []
                for index in started:
                    if index in counted:
                        continue  # done and counted: no need to ask the store
                    if client.exists(shard_lease_key(namespace, job.job_id, index)):
                        alive.append(index)
                        continue  # a live run holds it
                    if repository.store.exists(layout.shard_result_key(index)):
                        _count_late(repository, layout, index, send_finalize)
                        continue  # done
                    queue = queue or context.registry.queue_for(repository.get_spec(job.job_id).model)
                    if not shard_resend.may_resend(client, namespace, job.job_id, index, grace_s=grace_s,
                                                   gap_s=gap_s, queue_is_empty=queue_is_empty(queue)):
                        continue  # within its grace, waiting for a retry, or a copy sent is waiting
                    send_shard(job.job_id, index, queue)
                    shard_resend.resent(client, namespace, job.job_id, index)
                    metrics.REAPER_RESENDS.labels("shard").inc()
                    resent.append((job.job_id, index))
                    logger.warning("job %s shard %d: started, no result, no live lease; re-sent to %s",
                                   job.job_id, index, queue)
                shard_resend.seen_alive(client, namespace, job.job_id, alive)
            except Exception:  # noqa: BLE001 - one odd job must not stop the others
                logger.exception("shard reaper: job %s skipped", job.job_id)
        if cursor is None:
            return resent


def _count_late(repository: JobRepository, layout: JobLayout, index: int, send_finalize: SendJobStep) -> None:
    """The run committed the shard's result, then died before counting it: count it now."""
    result = committed_result(repository, layout, index)
    if result is None:
        return
    logger.warning("job %s shard %d: done but not counted (its run died); counting it", layout.job_id, index)
    count_shard(repository, layout, repository.load_plan(layout.job_id), result, send_finalize)


def reap_job_steps(context: WorkerContext, send_plan: SendJobStep, send_finalize: SendJobStep,
                   ttl_s: float) -> list[tuple[str, str]]:
    """One pass over the jobs whose plan or finalize may have died; returns the (job, step) pairs
    it re-sent."""
    repository = context.repository
    client, namespace = repository.redis, repository.namespace
    resent: list[tuple[str, str]] = []
    for state in (JobState.QUEUED, JobState.RUNNING, JobState.FINALIZING):
        cursor: str | None = None
        while True:
            jobs, cursor = repository.list(state, cursor=cursor, limit=100)
            for job in jobs:
                all_counted = bool(job.shards.total) and job.shards.done >= job.shards.total
                if state == JobState.FINALIZING or (state == JobState.RUNNING and all_counted):
                    step, send = "finalize", send_finalize
                elif state == JobState.QUEUED or not client.exists(dispatched_key(namespace, job.job_id)):
                    step, send = "plan", send_plan
                else:
                    continue
                if client.exists(step_lease_key(namespace, job.job_id, step)):
                    continue  # a live run holds it
                if _due_for_resend(client, step_due_key(namespace, job.job_id, step), 2 * ttl_s):
                    send(job.job_id)
                    metrics.REAPER_RESENDS.labels(step).inc()
                    resent.append((job.job_id, step))
                    logger.warning("job %s (%s): %s due, no live run; re-sent", job.job_id, state.value, step)
            if cursor is None:
                break
    return resent


def reap_lost_tickets(context: WorkerContext, count_tickets: CountTickets, send_ticket: SendTicket,
                      ttl_s: float) -> dict[str, int]:
    """One pass over the dispatched running jobs: per model queue, the tickets sent for shards that
    wait in the fair queue with none left in the broker to take them. Redis only: no job's spec is
    read (a job's shards wait under its own model's queue and no other)."""
    repository = context.repository
    client, namespace = repository.redis, repository.namespace
    job_ids: list[str] = []
    cursor: str | None = None
    while True:
        jobs, cursor = repository.list(JobState.RUNNING, cursor=cursor, limit=100)
        # A job not yet dispatched is still being offered (or its planner died: reap_job_steps).
        job_ids += [job.job_id for job in jobs if client.exists(dispatched_key(namespace, job.job_id))]
        if cursor is None:
            break
    fair = FairQueue(client, namespace)
    queues = sorted({context.registry.queue_for(name) for name in context.registry.names()})
    waiting = {queue: fair.waiting_total(queue, job_ids) for queue in queues}
    sent: dict[str, int] = {}
    for queue, shards in waiting.items():
        due_key = f"{namespace}:tickets-missing:{queue}"
        missing = shards - count_tickets(queue) if shards else 0
        if missing <= 0:
            client.delete(due_key)  # the next shortfall starts its grace afresh
            continue
        if _due_for_resend(client, due_key, 2 * ttl_s):
            for _ in range(missing):
                send_ticket(queue)
            metrics.REAPER_RESENDS.labels("ticket").inc(missing)
            sent[queue] = missing
            logger.warning("%s: %d shard(s) waiting and %d ticket(s) fewer in the broker; sent them",
                           queue, shards, missing)
    return sent


def _due_for_resend(client: redis.Redis, key: str, grace_s: float) -> bool:
    """True once the step has been seen due (on every tick) for `grace_s`; then again every `grace_s`."""
    now = time.time()
    if client.set(key, now, nx=True, ex=DUE_TTL_S):
        return False  # first seen now
    seen = float(client.get(key) or now)
    if now - seen < grace_s:
        return False
    client.set(key, now, ex=DUE_TTL_S)
    return True


def _sweep_uploads(context: WorkerContext) -> None:
    """Now and then (one worker, once per ORPHAN_SWEEP_S): inputs of uploads that never became a job,
    and /v1 file uploads that never got their record."""
    repository = context.repository
    if not repository.redis.set(orphan_sweep_key(repository.namespace), 1, nx=True,
                                px=int(ORPHAN_SWEEP_S * 1000)):
        return
    swept = sweep_orphan_uploads(repository.store, repository.prefix)
    if swept.inputs_removed or swept.writes_aborted:
        logger.warning("removed %d input(s) and aborted %d unfinished upload(s) that never became a job",
                       swept.inputs_removed, swept.writes_aborted)
    if swept.files_removed or swept.file_writes_aborted:
        logger.warning("removed %d /v1 file(s) and aborted %d unfinished /v1 file upload(s) that never got "
                       "their record", swept.files_removed, swept.file_writes_aborted)


def tick(context: WorkerContext) -> None:
    """One reaper pass: jobs past their deadline, shards, then plans and finalizes, lost tickets, then
    (every 10 min) orphaned uploads."""
    from bulkinfer.worker.process.tasks import (
        broker_ticket_count,
        send_finalize,
        send_plan,
        send_shard,
        send_ticket,
    )
    from bulkinfer.worker.process.webhook_delivery import notify_if_final

    ttl_s = context.settings.lease_ttl
    expire_due(context, send_finalize, notify=lambda job_id: notify_if_final(context, job_id))
    reap_once(context, send_shard, ttl_s, send_finalize)
    reap_job_steps(context, send_plan, send_finalize, ttl_s)
    reap_lost_tickets(context, broker_ticket_count, send_ticket, ttl_s)
    _sweep_uploads(context)


def start_reaper(settings: Settings) -> threading.Event:
    """Start the reaper thread (daemon), ticking every `settings.reaper_tick` on one worker at a
    time; set the returned event to stop it."""
    return start_periodic("shard-reaper", settings, settings.reaper_tick, tick)
