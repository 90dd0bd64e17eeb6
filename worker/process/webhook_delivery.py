"""Completion webhooks: when a job with a `webhook_url` ends, POST its final status, signed.

`notify_if_final` runs after the tasks that can end a job (plan, a failed or cancelled shard,
finalize), and the API's cancel does the same; a Redis marker per job (`SET NX`,
jobs/webhook_claims.py) makes exactly one of them send `bulkinfer.deliver_webhook`. The delivery
task retries connection errors, timeouts, 5xx and 429 after base·2^n seconds (at most 10 min apart)
up to the attempt limit; other 4xx answers are final. The marker ends as `delivered` or
`failed: <why>`. Delivery is at-least-once: an answer lost after the receiver acted makes it see
the delivery again (same X-Bulkinfer-Delivery id).
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlparse

import httpx
from celery import Task

from bulkinfer.jobs import webhooks
from bulkinfer.jobs.names import CONTROL_QUEUE, DELIVER_WEBHOOK, webhook_claim_key
from bulkinfer.jobs.webhook_claims import MARKER_TTL_S, claim_delivery
from bulkinfer.worker.process.celery_app import app
from bulkinfer.worker.process.context import WorkerContext, worker_context
from bulkinfer.worker.transient import is_transient

logger = logging.getLogger(__name__)

DEFAULT_MAX_ATTEMPTS = 8
DEFAULT_RETRY_BASE_S = 2.0
MAX_RETRY_DELAY_S = 600.0
REQUEST_TIMEOUT_S = 10.0


class RetryableDelivery(Exception):
    """The receiver could not take it now (unreachable, timeout, 5xx, 429): try again later."""


class RejectedDelivery(Exception):
    """The receiver refused it (4xx other than 408/429): retrying would not help."""


def delivery_state(context: WorkerContext, job_id: str) -> str | None:
    """`queued`, `delivered`, `failed: …`, or None when no delivery was started."""
    repository = context.repository
    value = repository.redis.get(webhook_claim_key(repository.namespace, job_id))
    return value.decode() if isinstance(value, bytes) else value


def send_delivery(job_id: str) -> None:
    app.send_task(DELIVER_WEBHOOK, args=[job_id], queue=CONTROL_QUEUE, task_id=f"{job_id}.webhook")


def notify_if_final(context: WorkerContext, job_id: str,
                    send: Callable[[str], None] = send_delivery) -> bool:
    """Start the job's webhook delivery if it has ended and has a URL, once per job."""
    if not claim_delivery(context.repository, job_id):
        return False  # not ended, no URL, or another task (or the API's cancel) started it
    send(job_id)
    return True


def post(url: str, body: bytes, headers: dict[str, str], *, allow_private: bool = False) -> int:
    """POST once; the status code on 2xx, else `RetryableDelivery` / `RejectedDelivery`.

    Unless `allow_private`, the host is resolved here and every address checked
    (`webhooks.address_problem`), and the request goes to the checked address (the name kept for
    the Host header and TLS), so a name that resolves elsewhere a moment later (DNS rebinding)
    cannot turn a webhook into a request to an internal service. Redirects are not followed, and
    nothing of the answer but its status code is kept.
    """
    target, host_header, extensions = url, None, {}
    if not allow_private:
        target, host_header, sni = _pinned(url)
        if sni:
            extensions["sni_hostname"] = sni
    request_headers = {**headers, **({"Host": host_header} if host_header else {})}
    try:
        with httpx.Client(timeout=REQUEST_TIMEOUT_S, follow_redirects=False, trust_env=False) as client:
            request = client.build_request("POST", target, content=body, headers=request_headers,
                                           extensions=extensions)
            response = client.send(request)
    except httpx.TransportError as error:  # refused, reset, timeout
        raise RetryableDelivery(f"{type(error).__name__}: {error}") from error
    if 200 <= response.status_code < 300:
        return response.status_code
    reason = f"HTTP {response.status_code}"
    if response.status_code >= 500 or response.status_code in (408, 429):
        raise RetryableDelivery(reason)
    if 300 <= response.status_code < 400:
        reason += " (redirects are not followed)"
    raise RejectedDelivery(reason)


def _pinned(url: str) -> tuple[str, str, str | None]:
    """(the URL with its host replaced by a checked address, the Host header, the TLS name)."""
    parsed = urlparse(url)
    host = parsed.hostname or ""
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        raise RetryableDelivery(f"cannot resolve {host!r}: {error}") from error
    addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
    for address in addresses:
        problem = webhooks.address_problem(address)
        if problem is not None:
            raise RejectedDelivery(problem)
    address = addresses[0]
    netloc = f"[{address}]" if ":" in address else address
    if parsed.port:
        netloc += f":{parsed.port}"
    host_header = host if not parsed.port else f"{host}:{parsed.port}"
    return parsed._replace(netloc=netloc).geturl(), host_header, host if parsed.scheme == "https" else None


def deliver(context: WorkerContext, job_id: str) -> dict[str, Any]:
    """One attempt: the job's status as GET /jobs/{id} gives it, signed, POSTed to its URL."""
    repository = context.repository
    if delivery_state(context, job_id) == "delivered":
        return {"job_id": job_id, "status": "skipped: already delivered"}
    status = repository.get(job_id)
    url = repository.get_spec(job_id).webhook_url
    if not url:
        return {"job_id": job_id, "status": "skipped: no webhook_url"}
    timestamp = int(time.time())
    body = webhooks.payload(status.model_dump(mode="json"), timestamp)
    headers = webhooks.headers(context.settings.webhook_secret, body, job_id, status.state.value, timestamp)
    settings = context.settings
    problem = webhooks.destination_problem(url, allow_http=bool(settings.webhook_allow_http),
                                           allow_private=bool(settings.webhook_allow_private))
    if problem is not None:  # the rules may have tightened since the job was submitted
        raise RejectedDelivery(problem)
    code = post(url, body, headers, allow_private=bool(settings.webhook_allow_private))
    repository.redis.set(webhook_claim_key(repository.namespace, job_id), "delivered", ex=MARKER_TTL_S)
    logger.info("job %s: webhook delivered to %s (HTTP %d)", job_id, webhooks.redacted(url), code)
    return {"job_id": job_id, "status": "delivered", "http_status": code}


def webhook_retry_delay_s(context: WorkerContext, retries: int) -> float:
    base = context.settings.webhook_retry_base_s or DEFAULT_RETRY_BASE_S
    return min(MAX_RETRY_DELAY_S, base * 2 ** retries)


def _give_up(context: WorkerContext, job_id: str, reason: str) -> dict[str, Any]:
    repository = context.repository
    key = webhook_claim_key(repository.namespace, job_id)
    repository.redis.set(key, f"failed: {reason}", ex=MARKER_TTL_S)
    logger.warning("job %s: webhook not delivered: %s", job_id, reason)
    return {"job_id": job_id, "status": "failed", "error": reason}


@app.task(name=DELIVER_WEBHOOK, bind=True, max_retries=None)
def deliver_webhook(self: Task, job_id: str) -> dict[str, Any]:
    context = worker_context()
    attempts = context.settings.webhook_max_attempts or DEFAULT_MAX_ATTEMPTS
    try:
        return deliver(context, job_id)
    except RejectedDelivery as error:
        return _give_up(context, job_id, str(error))
    except Exception as error:
        if not isinstance(error, RetryableDelivery) and not is_transient(error):
            raise
        if self.request.retries + 1 >= attempts:
            return _give_up(context, job_id, f"{attempts} attempts; last: {error}")
        delay = webhook_retry_delay_s(context, self.request.retries)
        logger.warning("job %s: webhook attempt %d failed (%s); retrying in %.1fs", job_id,
                       self.request.retries + 1, error, delay)
        raise self.retry(exc=error, countdown=delay, max_retries=None) from error
