"""Starting a finished job's webhook delivery once, from whichever process sees the end first.

Workers see a job end in plan, shard and finalize tasks; the API sees it end when a cancel lands on
a job that no worker is running. Both claim the delivery through one Redis marker per job (`SET NX`)
and only the winner sends `bulkinfer.deliver_webhook` (worker/process/webhook_delivery.py), so a job's
webhook starts once however many processes see it end.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from bulkinfer.jobs.names import webhook_claim_key

if TYPE_CHECKING:
    from bulkinfer.jobs.state.repository import JobRepository

MARKER_TTL_S = 30 * 24 * 3600


def claim_delivery(repository: JobRepository, job_id: str) -> bool:
    """True once per job: when it has ended, has a `webhook_url`, and nobody claimed it before."""
    if not repository.get(job_id).state.is_terminal:
        return False
    if not repository.get_spec(job_id).webhook_url:
        return False
    return bool(repository.redis.set(webhook_claim_key(repository.namespace, job_id), "queued", nx=True,
                                     ex=MARKER_TTL_S))
