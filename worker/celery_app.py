"""The Celery application and the settings that keep shard work from being lost or doubled.

`worker.celery_app:app` is the pipeline's app: `celery -A worker.celery_app worker --pool=threads
--concurrency=2 -Q bulkinfer.control,bulkinfer.model.<name>` (or `bulkinfer serve worker`).
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery, signals

from jobs.names import CONTROL_QUEUE, FINALIZE_JOB, PLAN_JOB
from jobs.settings import process_settings

# A shard must never run longer than this, or Redis hands it to a second worker while the first
# still runs (celery#5935). Shards are sized to take minutes; 12 hours leaves a wide margin.
VISIBILITY_TIMEOUT_S = 12 * 3600

logger = logging.getLogger(__name__)


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
        result_expires=7 * 24 * 3600,
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
        include=["worker.tasks"],
        task_default_queue=CONTROL_QUEUE,
        task_routes={PLAN_JOB: {"queue": CONTROL_QUEUE}, FINALIZE_JOB: {"queue": CONTROL_QUEUE}},
        worker_pool="threads",
        worker_concurrency=2,
        task_track_started=True,
    )
    return app


# The process's settings (flags of `serve worker`, else the variables over the config file, read
# once): a worker started with plain `celery -A worker.celery_app worker` gets the file too.
app = create_pipeline_app()


@signals.worker_init.connect
def _import_shared_libraries(sender: Any = None, **_: Any) -> None:
    """Before any task or engine thread starts: see worker/eager_imports.py."""
    from worker.eager_imports import import_shared_libraries

    import_shared_libraries()


@signals.worker_ready.connect
def _preload_models(sender: Any = None, **_: Any) -> None:
    """Start loading the worker's models in a background thread: never in `worker_process_init`
    (Celery kills its handlers after ~4 s), and never in a parent that will fork pool children.
    """
    names = process_settings().preload_models
    if not names or sender is None or getattr(sender, "app", None) is not app:
        return
    pool = getattr(getattr(sender, "controller", None), "pool_cls", None)
    if "prefork" in getattr(pool, "__module__", str(pool)):
        logger.warning("not preloading %s in a prefork parent; each child loads on its first shard", names)
        return
    from worker.context import worker_context

    worker_context().hosts.preload(names)


@signals.worker_ready.connect
def _start_shard_reaper(sender: Any = None, **_: Any) -> None:
    """Every pipeline worker runs the shard reaper (`worker/shard_reaper.py`) in a background thread."""
    if sender is None or getattr(sender, "app", None) is not app:
        return
    from worker.shard_reaper import start_reaper

    start_reaper(process_settings())


@signals.worker_ready.connect
def _start_schedule_ticker(sender: Any = None, **_: Any) -> None:
    """Every pipeline worker runs the schedule ticker (`worker/schedule_ticker.py`) in a thread."""
    if sender is None or getattr(sender, "app", None) is not app:
        return
    from worker.schedule_ticker import start_ticker

    start_ticker(process_settings())


_status_server = None  # this process's StatusServer, once the worker is up


@signals.worker_ready.connect
def _start_status_server(sender: Any = None, **_: Any) -> None:
    """/metrics, /healthz and /readyz on `worker_metrics_port`, and the heartbeat the API reads."""
    global _status_server
    if sender is None or getattr(sender, "app", None) is not app:
        return
    from worker import metrics
    from worker.context import worker_context
    from worker.status_server import StatusServer

    settings, context = process_settings(), worker_context()
    metrics.register_engines(context.hosts.hosted)
    try:
        _status_server = StatusServer(context, sender.hostname, settings.preload_models,
                                      settings.worker_metrics_port).start()
    except OSError as error:  # the port is taken: the worker still works, unobserved
        logger.error("worker status endpoint not started on port %d: %s (set worker_metrics_port)",
                     settings.worker_metrics_port, error)


@signals.worker_shutting_down.connect
def _hand_back_running_shards(**_: Any) -> None:
    """SIGTERM (or Ctrl-C): running shards hand themselves back (worker/shutdown.py)."""
    from worker import shutdown

    logger.info("worker stopping: running shards are handed back to their queues")
    shutdown.begin()


@signals.worker_shutdown.connect
def _stop_worker_services(**_: Any) -> None:
    """After the last task returned: the endpoint and heartbeat, then the engines, whose threads
    must end before the interpreter does (a step still running at exit aborts the process)."""
    if _status_server is not None:
        _status_server.stop()
    from worker.context import built_worker_context

    context = built_worker_context()
    if context is not None:
        context.hosts.stop()


@signals.after_setup_logger.connect
def _json_logs(loglevel: Any = None, **_: Any) -> None:
    """`log_format = "json"`: Celery's root handlers write JSON lines instead (jobs/log_format.py);
    text, Celery's own format, stays the default."""
    settings = process_settings()
    if settings.log_format != "json":
        return
    from jobs.log_format import configure_json_logging

    configure_json_logging(loglevel or logging.INFO, settings.log_secrets())
