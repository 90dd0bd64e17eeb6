"""Every name the processes share by string: Celery task names, queues and Redis keys.

The API, the workers and the tools (`bench faults`, `up`) send to and read from each other only
through these, so each is spelled here once. Redis keys of one job share the hash tag `{<job id>}`
(one Redis Cluster slot, so a script may touch several); every key starts with the deployment's
namespace (`bulkinfer` by default).
"""

from __future__ import annotations

# ---- Celery tasks and queues -------------------------------------------------------------------
PLAN_JOB = "bulkinfer.plan_job"
RUN_SHARD = "bulkinfer.run_shard"
NO_TENANT = "-"  # stands for the tenant of jobs an open API took (no keys) in Redis keys and members
RUN_NEXT_SHARD = "bulkinfer.run_next_shard"  # a ticket: run the fair queue's next shard (jobs/fair_queue.py)
FINALIZE_JOB = "bulkinfer.finalize_job"
DELIVER_WEBHOOK = "bulkinfer.deliver_webhook"
CONTROL_QUEUE = "bulkinfer.control"  # plan, finalize and webhooks
QUEUE_PREFIX = "bulkinfer.model."  # a model's shards: bulkinfer.model.<name>


def model_queue(model: str) -> str:
    return f"{QUEUE_PREFIX}{model}"


# ---- Redis keys of one job ---------------------------------------------------------------------
def job_key(namespace: str, job_id: str, *parts: str | int) -> str:
    """`<namespace>:job:{<job id>}:<part>:…`: the one form of a job's keys."""
    return ":".join([f"{namespace}:job:{{{job_id}}}", *map(str, parts)])


def cancel_key(namespace: str, job_id: str) -> str:
    return job_key(namespace, job_id, "cancel")


def counts_key(namespace: str, job_id: str) -> str:
    return job_key(namespace, job_id, "counts")


def counted_shards_key(namespace: str, job_id: str) -> str:
    return job_key(namespace, job_id, "counted-shards")


def live_progress_key(namespace: str, job_id: str) -> str:
    """Running shards' finished rows, before they commit (jobs/state/live_progress.py)."""
    return job_key(namespace, job_id, "live")


def webhook_claim_key(namespace: str, job_id: str) -> str:
    return job_key(namespace, job_id, "webhook")


def shard_lease_key(namespace: str, job_id: str, shard_index: int) -> str:
    return job_key(namespace, job_id, "shard", shard_index, "lease")


def shard_resent_key(namespace: str, job_id: str, shard_index: int) -> str:
    return job_key(namespace, job_id, "shard", shard_index, "resent")


def shards_started_key(namespace: str, job_id: str) -> str:
    """A set of the job's shard indexes that some run has taken the lease of."""
    return job_key(namespace, job_id, "shards-started")


def step_lease_key(namespace: str, job_id: str, step: str) -> str:
    """The lease of a job-wide step ("plan", "finalize")."""
    return job_key(namespace, job_id, step, "lease")


def step_due_key(namespace: str, job_id: str, step: str) -> str:
    return job_key(namespace, job_id, step, "due")


def dispatched_key(namespace: str, job_id: str) -> str:
    """Set once every shard task of the job was sent: a planner that died before has to run again."""
    return job_key(namespace, job_id, "dispatched")


def schemas_key(namespace: str, job_id: str) -> str:
    return job_key(namespace, job_id, "schemas")


def failures_key(namespace: str, job_id: str, step: str) -> str:
    return job_key(namespace, job_id, "failures", step)


# ---- Redis keys of the deployment --------------------------------------------------------------
def jobs_tag(namespace: str) -> str:
    """The hash-tagged prefix of the job index and state hashes (one slot for their scripts)."""
    return f"{namespace}:{{jobs}}"


def schedule_key(namespace: str, schedule_id: str, what: str) -> str:
    return f"{namespace}:schedule:{{{schedule_id}}}:{what}"


def periodic_lock_key(namespace: str, name: str) -> str:
    """The lock that lets one worker at a time run a periodic task (`shard-reaper`, …)."""
    return f"{namespace}:{name}:lock"


def orphan_sweep_key(namespace: str) -> str:
    return f"{namespace}:orphan-upload-sweep"


def rate_key(namespace: str, who: str, second: int) -> str:
    return f"{namespace}:rate:{who}:{second}"


def auth_failures_key(namespace: str, address: str, minute: int) -> str:
    return f"{namespace}:auth-failures:{address}:{minute}"


def auth_known_key(namespace: str, address: str) -> str:
    """Digests of the keys that authenticated from an address lately."""
    return f"{namespace}:auth-known:{address}"


# ---- Workers -----------------------------------------------------------------------------------
def worker_beat_key(namespace: str, hostname: str) -> str:
    """A live worker's latest heartbeat (jobs/workers.py); it expires when the worker stops beating."""
    return f"{namespace}:worker:{hostname}"


def worker_beat_pattern(namespace: str) -> str:
    return f"{namespace}:worker:*"
