"""The Celery application and the settings that keep shard work from being lost or doubled."""

from __future__ import annotations

import os

from celery import Celery

DEFAULT_BROKER_URL = "redis://127.0.0.1:6379/0"

# A shard must never run longer than this, or Redis hands it to a second worker while the first
# still runs (celery#5935). Shards are sized to take minutes; 12 hours leaves a wide margin.
VISIBILITY_TIMEOUT_S = 12 * 3600


def broker_url_from_env() -> str:
    return os.environ.get("BULKINFER_BROKER_URL", DEFAULT_BROKER_URL)


def create_app(broker_url: str | None = None, name: str = "bulkinfer") -> Celery:
    """A Celery app wired for long, idempotent tasks on a Redis broker."""
    url = broker_url or broker_url_from_env()
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
