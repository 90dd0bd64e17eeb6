"""What a pipeline worker runs beside its tasks, started and stopped on Celery's worker signals:
model preloading, the shard reaper, the schedule ticker, the status server (/metrics, /healthz,
/readyz, the heartbeat), and on SIGTERM the hand-back of running shards.

Listed in the app's `include` (worker/process/celery_app.py), so that a worker imports it when it
starts while celery_app imports none of these services: they import the tasks, which import the app.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import signals

from bulkinfer.jobs.settings import process_settings
from bulkinfer.worker.process.celery_app import app

logger = logging.getLogger(__name__)


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
    from bulkinfer.worker.process.context import worker_context

    worker_context().hosts.preload(names)


@signals.worker_ready.connect
def _start_shard_reaper(sender: Any = None, **_: Any) -> None:
    """Every pipeline worker runs the shard reaper (`worker/shards/shard_reaper.py`) in a background
    thread."""
    if sender is None or getattr(sender, "app", None) is not app:
        return
    from bulkinfer.worker.shards.shard_reaper import start_reaper

    start_reaper(process_settings())


@signals.worker_ready.connect
def _start_schedule_ticker(sender: Any = None, **_: Any) -> None:
    """Every pipeline worker runs the schedule ticker (`worker/process/schedule_ticker.py`) in a thread."""
    if sender is None or getattr(sender, "app", None) is not app:
        return
    from bulkinfer.worker.process.schedule_ticker import start_ticker

    start_ticker(process_settings())


_activity = None  # this process's ConsumerActivity, once the worker is up (consumer_watchdog.py)
_watchdog_stop = None  # set when the worker shuts down: it stops consuming on purpose then


@signals.task_received.connect
def _note_received(**_: Any) -> None:
    if _activity is not None:
        _activity.received()


@signals.task_prerun.connect
def _note_started(**_: Any) -> None:
    if _activity is not None:
        _activity.started()


@signals.task_postrun.connect
def _note_finished(**_: Any) -> None:
    if _activity is not None:
        _activity.finished()


@signals.worker_ready.connect
def _start_consumer_watchdog(sender: Any = None, **_: Any) -> None:
    """A worker whose broker consumer stalled stops itself, to be replaced (consumer_watchdog.py)."""
    global _activity, _watchdog_stop
    if sender is None or getattr(sender, "app", None) is not app:
        return
    import threading

    from bulkinfer.worker.process.consumer_watchdog import ConsumerActivity, watch
    from bulkinfer.worker.process.tasks import broker_ticket_count

    _activity, _watchdog_stop = ConsumerActivity(), threading.Event()
    pipeline: Any = app  # (the check above narrowed `app` to the sender's attribute's type)
    queues = sorted(pipeline.amqp.queues.consume_from)  # the queues this worker consumes (-Q)
    controller = getattr(sender, "controller", None)  # sender: the worker's consumer
    concurrency = int(getattr(controller, "concurrency", 0) or pipeline.conf.worker_concurrency or 1)
    threading.Thread(target=watch, name="consumer-watchdog", daemon=True,
                     args=(_activity, queues, concurrency, broker_ticket_count, _watchdog_stop)).start()


_status_server = None  # this process's StatusServer, once the worker is up


@signals.worker_ready.connect
def _start_status_server(sender: Any = None, **_: Any) -> None:
    """/metrics, /healthz and /readyz on `worker_metrics_port`, and the heartbeat the API reads."""
    global _status_server
    if sender is None or getattr(sender, "app", None) is not app:
        return
    from bulkinfer.worker.process import engine_metrics
    from bulkinfer.worker.process.context import worker_context
    from bulkinfer.worker.process.status_server import StatusServer

    settings, context = process_settings(), worker_context()
    engine_metrics.register_engines(context.hosts.hosted)
    try:
        _status_server = StatusServer(context, sender.hostname, settings.preload_models,
                                      settings.worker_metrics_port).start()
    except OSError as error:  # the port is taken: the worker still works, unobserved
        logger.error("worker status endpoint not started on port %d: %s (set worker_metrics_port)",
                     settings.worker_metrics_port, error)


@signals.worker_shutting_down.connect
def _hand_back_running_shards(**_: Any) -> None:
    """SIGTERM (or Ctrl-C): running shards hand themselves back (worker/process/shutdown.py)."""
    from bulkinfer.worker.process import shutdown

    if _watchdog_stop is not None:
        _watchdog_stop.set()  # no longer consuming, on purpose
    logger.info("worker stopping: running shards are handed back to their queues")
    shutdown.begin()


@signals.worker_shutdown.connect
def _stop_worker_services(**_: Any) -> None:
    """After the last task returned: the endpoint and heartbeat, then the engines, whose threads
    must end before the interpreter does (a step still running at exit aborts the process)."""
    if _status_server is not None:
        _status_server.stop()
    from bulkinfer.worker.process.context import built_worker_context

    context = built_worker_context()
    if context is not None:
        context.hosts.stop()
