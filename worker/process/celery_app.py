"""The Celery application and the settings that keep shard work from being lost or doubled.

`bulkinfer.worker.process.celery_app:app` is the pipeline's app: `celery -A
bulkinfer.worker.process.celery_app worker --pool=threads
--concurrency=2 -Q bulkinfer.control,bulkinfer.model.<name>` (or `bulkinfer serve worker`).
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery, signals

from bulkinfer.cpu_isa import apply_cpu_isa_cap
from bulkinfer.jobs.names import CONTROL_QUEUE, FINALIZE_JOB, PLAN_JOB
from bulkinfer.jobs.settings import process_settings

# A shard must never run longer than this, or Redis hands it to a second worker while the first
# still runs (celery#5935). Shards are sized to take minutes; 12 hours leaves a wide margin.
VISIBILITY_TIMEOUT_S = 12 * 3600


def create_app(broker_url: str | None = None, name: str = "bulkinfer") -> Celery:
    """A Celery app wired for long, idempotent tasks on a Redis broker (default: this process's
    `broker_url` setting)."""
    url = broker_url or process_settings().broker_url
    app = Celery(name, broker=url, backend=url)
    app.conf.update(
        # Ack only after the task ran, and requeue it if the worker process dies mid-task.
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        # One task in hand at a time: a shard is long, and a prefetched one would wait behind it.
        worker_prefetch_multiplier=1,
        broker_transport_options={
            "visibility_timeout": VISIBILITY_TIMEOUT_S,
            # Scan for unacked messages to restore every 10 s instead of every ~100 s.
            "unacked_restore_interval": 10,
            "unacked_restore_throttle": 1,
        },
        broker_connection_retry_on_startup=True,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        # Nothing reads a task's return value (a job's state lives in the repository), and writing
        # it is a Redis SET per task: kept 7 days it only filled Redis, and refused under Redis's
        # memory limit it left the message unacknowledged, which stalled the consumer for good.
        task_ignore_result=True,
        worker_hijack_root_logger=False,
    )
    return app


def create_pipeline_app(broker_url: str | None = None) -> Celery:
    """The app with the pipeline's tasks: plan and finalize on the control queue, shards on their
    model's queue (`bulkinfer.model.<name>`, chosen per task by the planner).

    Threads, not processes: the engine lives in the worker process and two task threads feed it,
    so one shard's rows wait in the engine while the other's finish (no drain between shards).
    """
    app = create_app(broker_url)
    app.conf.update(
        # Imported when a worker starts (the tasks, and the signal handlers that start its services),
        # never by this module: everything else imports `app` from here.
        include=["bulkinfer.worker.process.tasks", "bulkinfer.worker.process.worker_services"],
        task_default_queue=CONTROL_QUEUE,
        task_routes={PLAN_JOB: {"queue": CONTROL_QUEUE}, FINALIZE_JOB: {"queue": CONTROL_QUEUE}},
        worker_pool="threads",
        worker_concurrency=2,
    )
    return app


# The process's settings (flags of `serve worker`, else the variables over the config file, read
# once): a worker started with plain `celery -A bulkinfer.worker.process.celery_app worker` gets the file too.
app = create_pipeline_app()
# The `cpu_isa` setting (a flag of `serve worker`, or the config file) before the engine imports torch.
apply_cpu_isa_cap(process_settings().cpu_isa)


@signals.worker_init.connect
def _import_shared_libraries(sender: Any = None, **_: Any) -> None:
    """Before any task or engine thread starts: see worker/process/eager_imports.py."""
    from bulkinfer.worker.process.eager_imports import import_shared_libraries

    import_shared_libraries()


@signals.after_setup_logger.connect
def _json_logs(loglevel: Any = None, **_: Any) -> None:
    """`log_format = "json"`: Celery's root handlers write JSON lines instead (jobs/log_format.py);
    text, Celery's own format, stays the default."""
    settings = process_settings()
    if settings.log_format != "json":
        return
    from bulkinfer.jobs.log_format import configure_json_logging

    configure_json_logging(loglevel or logging.INFO, settings.log_secrets())
