"""The pipeline's Celery tasks (names fixed by docs/pipeline.md; the API sends them by name).

Thin wrappers: the work is in `job_lifecycle` and `shard_runner`, which know nothing of Celery.
Task ids are deterministic (`<job>.shard.<n>`, `<job>.finalize`), so a task sent twice is easy to
spot in logs and results, and tests can wait on a shard's result by id.
"""

from __future__ import annotations

from typing import Any

from jobs.models import CONTROL_QUEUE
from worker import job_lifecycle, shard_runner
from worker.celery_app import app
from worker.context import worker_context

PLAN_JOB = "bulkinfer.plan_job"
RUN_SHARD = "bulkinfer.run_shard"
FINALIZE_JOB = "bulkinfer.finalize_job"


def shard_task_id(job_id: str, shard_index: int) -> str:
    return f"{job_id}.shard.{shard_index:05d}"


def finalize_task_id(job_id: str) -> str:
    return f"{job_id}.finalize"


def send_shard(job_id: str, shard_index: int, queue: str) -> None:
    app.send_task(RUN_SHARD, args=[job_id, shard_index], queue=queue,
                  task_id=shard_task_id(job_id, shard_index))


def send_finalize(job_id: str) -> None:
    app.send_task(FINALIZE_JOB, args=[job_id], queue=CONTROL_QUEUE, task_id=finalize_task_id(job_id))


@app.task(name=PLAN_JOB)
def plan_job(job_id: str) -> dict[str, Any]:
    return job_lifecycle.plan_job(worker_context(), job_id, send_shard)


@app.task(name=RUN_SHARD)
def run_shard(job_id: str, shard_index: int) -> dict[str, Any]:
    return shard_runner.run_shard(worker_context(), job_id, shard_index, send_finalize)


@app.task(name=FINALIZE_JOB)
def finalize_job(job_id: str) -> dict[str, Any]:
    return job_lifecycle.finalize_job(worker_context(), job_id)
