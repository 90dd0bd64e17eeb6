"""The pipeline's Celery tasks (names fixed by docs/job-pipeline.md; the API sends them by name).

Thin wrappers: the work is in `job_lifecycle` and `shard_runner`, which know nothing of Celery.
Task ids are deterministic (`<job>.shard.<n>`, `<job>.finalize`), so a task sent twice is easy to
spot in logs and results, and tests can wait on a shard's result by id.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import redis
from celery import Celery, Task
from celery.exceptions import Retry
from kombu.exceptions import ChannelError, OperationalError

from bulkinfer.jobs.fair_queue import FairQueue, TakenShard
from bulkinfer.jobs.log_format import log_context
from bulkinfer.jobs.names import CONTROL_QUEUE, FINALIZE_JOB, PLAN_JOB, RUN_NEXT_SHARD, RUN_SHARD
from bulkinfer.jobs.output_tokens import expected_output_tokens
from bulkinfer.jobs.planning.shard_cost import shard_token_cost
from bulkinfer.jobs.spec import JobSpec
from bulkinfer.worker.process import metrics, shutdown, webhook_delivery
from bulkinfer.worker.process.celery_app import app
from bulkinfer.worker.process.context import WorkerContext, worker_context
from bulkinfer.worker.shards import job_lifecycle, shard_resend, shard_runner
from bulkinfer.worker.shards.task_attempts import DEFAULT_MAX_ATTEMPTS, failure_message, record_failure
from bulkinfer.worker.transient import is_transient, retry_delay_s

logger = logging.getLogger(__name__)



def shard_task_id(job_id: str, shard_index: int) -> str:
    return f"{job_id}.shard.{shard_index:05d}"


def finalize_task_id(job_id: str) -> str:
    return f"{job_id}.finalize"


def send_plan(job_id: str) -> None:
    app.send_task(PLAN_JOB, args=[job_id], queue=CONTROL_QUEUE)


def send_shard(job_id: str, shard_index: int, queue: str) -> None:
    app.send_task(RUN_SHARD, args=[job_id, shard_index], queue=queue,
                  task_id=shard_task_id(job_id, shard_index))


class ShardOffers:
    """The planner's `send_shard`: offer the shard to the fair queue, then send the model's queue a
    ticket (one per shard), so the worker that takes it runs whichever shard is fairest then. The
    job's spec and shard costs (estimated tokens) are read once per job; its priority is capped for
    its tenant (jobs/priority_caps.py)."""

    def __init__(self, context: WorkerContext) -> None:
        self.context = context
        self.queue = FairQueue(context.repository.redis, context.repository.namespace)
        self._jobs: dict[str, tuple[JobSpec, int, dict[int, int]]] = {}

    def __call__(self, job_id: str, shard_index: int, queue: str) -> None:
        if job_id not in self._jobs:
            repository, settings = self.context.repository, self.context.settings
            spec = repository.get_spec(job_id)
            expected = expected_output_tokens(repository.redis, repository.namespace, spec.model,
                                              settings.output_estimate)
            costs = {shard.index: shard_token_cost(shard, spec, expected)
                     for shard in repository.load_plan(job_id)}
            self._jobs[job_id] = (spec, settings.job_priority(spec), costs)
        spec, priority, costs = self._jobs[job_id]
        self.queue.offer(queue, job_id, shard_index, costs.get(shard_index, 1), priority, spec.tenant)
        send_ticket(queue)  # also when offered before


def send_ticket(queue: str, celery_app: Celery = app) -> None:
    """A ticket: whichever worker takes it runs the fair queue's next shard for `queue`."""
    celery_app.send_task(RUN_NEXT_SHARD, args=[queue], queue=queue)


def broker_ticket_count(queue: str, celery_app: Celery = app) -> int:
    """Messages waiting in the broker's `queue` (tickets and named shards); 0 for a queue it has not
    seen (Redis drops an emptied list, and a passive declare then finds no queue)."""
    with celery_app.connection_for_read() as connection:
        try:
            return int(connection.default_channel.queue_declare(queue=queue, passive=True).message_count)
        except ChannelError:
            return 0


def send_finalize(job_id: str) -> None:
    app.send_task(FINALIZE_JOB, args=[job_id], queue=CONTROL_QUEUE, task_id=finalize_task_id(job_id))


PUBLISH_DEADLINE_S = 15 * 60


def retry_published(task: Task, error: BaseException, delay: float,
                    sleep: Callable[[float], None] = time.sleep,
                    kwargs: dict[str, Any] | None = None) -> BaseException:
    """`task.retry`, sent again until the broker takes it. With Redis down, the retry message cannot
    be published, and a message dropped then would leave its job waiting for the 12 h visibility
    timeout; so this thread waits the outage out (up to PUBLISH_DEADLINE_S), then the retry goes.
    `kwargs`: the retry's keyword arguments instead of this run's (a ticket retries its shard)."""
    started, wait = time.monotonic(), 1.0
    while True:
        try:
            options = {} if kwargs is None else {"kwargs": kwargs}
            return task.retry(exc=error, countdown=delay, max_retries=None, **options)
        except Retry:
            raise
        except (OperationalError, redis.RedisError, OSError) as publish_error:
            if time.monotonic() - started > PUBLISH_DEADLINE_S:
                raise
            logger.warning("%s %s: the retry could not be sent (%s); trying again in %.0fs", task.name,
                           task.request.id, publish_error, wait)
            sleep(wait)
            wait = min(wait * 2, 30.0)


# Summaries of a task run that saw its job end: the job's webhook is due (worker/process/webhook_delivery.py).
ENDED_SUMMARIES = ("succeeded", "expired", "failed", "cancelled", "skipped: job")


def run_step(task: Task, context: WorkerContext, job_id: str, step: str, work: Callable[[], dict[str, Any]],
             retry_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run one step of a job (`step`: "plan", "shard 3", "finalize") and notify when the job ended.

    Redis or the store unreachable: retry later (with backoff, for as long as the outage lasts)
    instead of failing, since a failed task would leave its job stuck. Any other error: retry with
    backoff until the step has failed `max_task_attempts` times, then fail the job with the reason
    (worker/shards/task_attempts.py), so no step is re-sent forever.
    """
    step_kind, _, shard = step.partition(" ")  # "shard 3" -> "shard", "3"; "plan" -> "plan", ""
    try:
        with log_context(job_id=job_id, shard=shard or None, worker=getattr(task.request, "hostname", None)):
            summary = work()
    except Exception as error:
        if is_transient(error):
            metrics.record_transient(error)
            metrics.TASK_RETRIES.labels(step_kind, "transient").inc()
            delay = retry_delay_s(task.request.retries, context.settings.retry_max_delay)
            logger.warning("%s %s: %s; retrying in %.0fs", task.name, task.request.id, error, delay)
            shard_resend.hold_for_retry(context.repository.redis, context.repository.namespace, job_id, step,
                                        delay, context.settings.lease_ttl)
            raise retry_published(task, error, delay, kwargs=retry_kwargs) from error
        repository = context.repository
        attempts = record_failure(repository.redis, repository.namespace, job_id, step)
        limit = context.settings.max_task_attempts or DEFAULT_MAX_ATTEMPTS
        if attempts < limit:
            metrics.TASK_RETRIES.labels(step_kind, "error").inc()
            delay = retry_delay_s(attempts - 1, context.settings.retry_max_delay)
            logger.exception("job %s: %s failed (attempt %d of %d); retrying in %.0fs", job_id, step,
                             attempts, limit, delay)
            raise retry_published(task, error, delay, kwargs=retry_kwargs) from error
        message = failure_message(step, attempts, error)
        logger.exception("job %s: %s failed %d times; failing the job", job_id, step, attempts)
        job_lifecycle.fail_job(repository, job_id, message)
        summary = {"job_id": job_id, "status": "failed", "error": message}
    if str(summary.get("status", "")).startswith(ENDED_SUMMARIES):
        webhook_delivery.notify_if_final(context, job_id)
    return summary


@app.task(name=PLAN_JOB, bind=True, max_retries=None)
def plan_job(self: Task, job_id: str) -> dict[str, Any]:
    context = worker_context()
    return run_step(self, context, job_id, "plan",
                    lambda: job_lifecycle.plan_job(context, job_id, ShardOffers(context)))


@app.task(name=RUN_NEXT_SHARD, bind=True, max_retries=None)
def run_next_shard(self: Task, queue: str, job_id: str | None = None,
                   shard_index: int | None = None) -> dict[str, Any]:
    """A ticket: run the fair queue's next shard for this queue (or, when a run of one is retried,
    that shard again)."""
    context = worker_context()
    if job_id is None or shard_index is None:
        taken = take_next_shard(self, context, queue)
        if taken is None:
            return {"status": "nothing waiting"}
        job_id, shard_index = taken.job_id, taken.shard_index
    return _run_shard_step(self, context, job_id, shard_index,
                           retry_kwargs={"job_id": job_id, "shard_index": shard_index}, fair_queue=queue)


def take_next_shard(task: Task, context: WorkerContext, queue: str) -> TakenShard | None:
    """The fair queue's next shard for a ticket (None: nothing waiting). A Redis fault here
    (unreachable, OOM, BUSY…) retries the ticket with backoff, uncounted, as `run_step` retries a
    step: the take and its marking the shard started are one script, so nothing was taken and the
    retried ticket takes the fairest shard then. (Had the script run and only its reply been lost,
    the shard is started with no lease, which the reaper re-sends.) Failing the task instead lost
    the ticket until the reaper's lost-ticket pass, two lease TTLs later."""
    try:
        return FairQueue(context.repository.redis, context.repository.namespace).take(queue)
    except Exception as error:
        if not is_transient(error):
            raise
        metrics.record_transient(error)
        metrics.TASK_RETRIES.labels("take", "transient").inc()
        delay = retry_delay_s(task.request.retries, context.settings.retry_max_delay)
        logger.warning("%s %s: taking a shard of %s: %s; retrying in %.0fs", task.name, task.request.id,
                       queue, error, delay)
        raise retry_published(task, error, delay, kwargs={}) from error


@app.task(name=RUN_SHARD, bind=True, max_retries=None)
def run_shard(self: Task, job_id: str, shard_index: int) -> dict[str, Any]:
    """One named shard: sent by the reaper and by a worker handing a shard back."""
    return _run_shard_step(self, worker_context(), job_id, shard_index)


def _run_shard_step(self: Task, context: WorkerContext, job_id: str, shard_index: int,
                    retry_kwargs: dict[str, Any] | None = None,
                    fair_queue: str | None = None) -> dict[str, Any]:
    """`fair_queue`: the queue a ticket took the shard from; a cancelled job's other shards waiting
    there are dropped (inside the step, so a Redis fault meanwhile retries the shard, not loses it)."""
    def work() -> dict[str, Any]:
        if fair_queue is not None and context.repository.is_cancel_requested(job_id):
            # its other shards would only be taken to be skipped
            FairQueue(context.repository.redis, context.repository.namespace).drop(fair_queue, job_id)
        try:
            return shard_runner.run_shard(context, job_id, shard_index, send_finalize)
        except shutdown.ShardHandedBack:
            # The lease is released; the shard goes back to its queue before this message is acked.
            queue = (self.request.delivery_info or {}).get("routing_key") \
                or context.registry.queue_for(context.repository.get_spec(job_id).model)
            send_shard(job_id, shard_index, queue)
            logger.info("job %s shard %d: handed back to %s (the worker is stopping)", job_id, shard_index,
                        queue)
            return {"job_id": job_id, "shard_index": shard_index, "status": "handed back"}

    return run_step(self, context, job_id, f"shard {shard_index}", work, retry_kwargs)


@app.task(name=FINALIZE_JOB, bind=True, max_retries=None)
def finalize_job(self: Task, job_id: str) -> dict[str, Any]:
    context = worker_context()
    return run_step(self, context, job_id, "finalize", lambda: job_lifecycle.finalize_job(context, job_id))
