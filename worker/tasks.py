"""The pipeline's Celery tasks (names fixed by docs/pipeline.md; the API sends them by name).

Thin wrappers: the work is in `job_lifecycle` and `shard_runner`, which know nothing of Celery.
Task ids are deterministic (`<job>.shard.<n>`, `<job>.finalize`), so a task sent twice is easy to
spot in logs and results, and tests can wait on a shard's result by id.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from celery import Task

from jobs.models import CONTROL_QUEUE
from worker import job_lifecycle, shard_runner, webhook_delivery
from worker.celery_app import app
from worker.context import worker_context
from worker.transient import is_transient, retry_delay_s

logger = logging.getLogger(__name__)

PLAN_JOB = "bulkinfer.plan_job"
RUN_SHARD = "bulkinfer.run_shard"
FINALIZE_JOB = "bulkinfer.finalize_job"


def shard_task_id(job_id: str, shard_index: int) -> str:
    return f"{job_id}.shard.{shard_index:05d}"


def finalize_task_id(job_id: str) -> str:
    return f"{job_id}.finalize"


def send_plan(job_id: str) -> None:
    app.send_task(PLAN_JOB, args=[job_id], queue=CONTROL_QUEUE)


def send_shard(job_id: str, shard_index: int, queue: str) -> None:
    app.send_task(RUN_SHARD, args=[job_id, shard_index], queue=queue,
                  task_id=shard_task_id(job_id, shard_index))


def send_finalize(job_id: str) -> None:
    app.send_task(FINALIZE_JOB, args=[job_id], queue=CONTROL_QUEUE, task_id=finalize_task_id(job_id))


def retrying_transient_errors(task: Task, work: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run `work`; when Redis or the store is unreachable, retry the task later (with backoff, for
    as long as the outage lasts) instead of failing it: a failed task would leave its job stuck.
    """
    try:
        return work()
    except Exception as error:
        if not is_transient(error):
            raise
        delay = retry_delay_s(task.request.retries)
        logger.warning("%s %s: %s; retrying in %.0fs", task.name, task.request.id, error, delay)
        raise task.retry(exc=error, countdown=delay, max_retries=None) from error


# Summaries of a task run that saw its job end: the job's webhook is due (worker/webhook_delivery.py).
ENDED_SUMMARIES = ("succeeded", "failed", "cancelled", "skipped: job")


def notifying_when_ended(job_id: str, work: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
    def run() -> dict[str, Any]:
        summary = work()
        if str(summary.get("status", "")).startswith(ENDED_SUMMARIES):
            webhook_delivery.notify_if_final(worker_context(), job_id)
        return summary
    return run


@app.task(name=PLAN_JOB, bind=True)
def plan_job(self: Task, job_id: str) -> dict[str, Any]:
    return retrying_transient_errors(self, notifying_when_ended(
        job_id, lambda: job_lifecycle.plan_job(worker_context(), job_id, send_shard)))


@app.task(name=RUN_SHARD, bind=True)
def run_shard(self: Task, job_id: str, shard_index: int) -> dict[str, Any]:
    return retrying_transient_errors(self, notifying_when_ended(
        job_id, lambda: shard_runner.run_shard(worker_context(), job_id, shard_index, send_finalize)))


@app.task(name=FINALIZE_JOB, bind=True)
def finalize_job(self: Task, job_id: str) -> dict[str, Any]:
    return retrying_transient_errors(self, notifying_when_ended(
        job_id, lambda: job_lifecycle.finalize_job(worker_context(), job_id)))
