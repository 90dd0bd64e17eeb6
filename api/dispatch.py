"""Sending pipeline tasks by name: the API never imports the worker, only names its tasks."""

from __future__ import annotations

from typing import Protocol

from bulkinfer.jobs.names import CONTROL_QUEUE, PLAN_JOB


class TaskSender(Protocol):
    def send(self, name: str, args: list[object], queue: str) -> None: ...

    def close(self) -> None: ...


class CeleryTaskSender:
    """A Celery app used only to publish: same broker and serializer as the workers."""

    def __init__(self, broker_url: str) -> None:
        from celery import Celery

        self._app = Celery("bulkinfer-api", broker=broker_url)
        self._app.conf.update(task_serializer="json", accept_content=["json"],
                              broker_connection_retry_on_startup=False, broker_connection_max_retries=2)

    def send(self, name: str, args: list[object], queue: str) -> None:
        self._app.send_task(name, args=args, queue=queue, ignore_result=True)

    def close(self) -> None:
        self._app.close()


def enqueue_plan(sender: TaskSender, job_id: str) -> None:
    sender.send(PLAN_JOB, [job_id], CONTROL_QUEUE)
