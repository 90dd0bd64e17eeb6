"""`GET /healthz`: can this API reach Redis and the object store right now?"""

from __future__ import annotations

import logging
import os

from bulkinfer.api.dependencies import ApiContext
from bulkinfer.api.schemas import Health
from bulkinfer.jobs.layout import jobs_root

logger = logging.getLogger(__name__)


def _check_redis(context: ApiContext) -> str:
    context.repository.redis.ping()
    return "ok"


def _check_store(context: ApiContext) -> str:
    settings = context.settings
    if settings.is_local_store:
        root = settings.local_store_root()
        root.mkdir(parents=True, exist_ok=True)
        if not os.access(root, os.W_OK):
            raise PermissionError(f"{root} is not writable")
        return "ok"
    # One LIST request: unlike a HEAD, it tells a missing bucket or bad credentials apart.
    next(iter(context.store.list(jobs_root(context.repository.prefix))), None)
    return "ok"


def health(context: ApiContext, *, detailed: bool = True) -> Health:
    """Each check's answer. Not `detailed` (the route is open while API keys are set), a failure
    says only its kind: its message names hosts, ports, buckets and paths, which are the operator's
    (logged here), not for whoever asks."""
    checks: dict[str, str] = {}
    for name, check in (("redis", _check_redis), ("store", _check_store)):
        try:
            checks[name] = check(context)
        except Exception as error:  # noqa: BLE001 - any failure is the answer
            logger.warning("health check %s failing: %s: %s", name, type(error).__name__, error)
            checks[name] = f"failing: {type(error).__name__}" + (f": {error}" if detailed else "")
    return Health(status="ok" if all(value == "ok" for value in checks.values()) else "failing",
                  checks=checks)
