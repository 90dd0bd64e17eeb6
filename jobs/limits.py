"""The deployment's limits: per job (max_rows_per_job, max_shards_per_job: the planner fails a job
past them, and a dry run reports them) and per tenant (max_jobs_in_flight: counted the same way by
`POST /jobs`, retries and schedule ticks)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from bulkinfer.jobs.planning.sharding import ShardPlan
from bulkinfer.jobs.settings import Settings
from bulkinfer.jobs.state.status import JobState

if TYPE_CHECKING:
    from bulkinfer.jobs.state.repository import JobRepository

ACTIVE_STATES = (JobState.QUEUED, JobState.RUNNING, JobState.FINALIZING)


def jobs_in_flight(repository: JobRepository, tenant: str | None, up_to: int) -> int:
    """How many of `tenant`'s jobs (None: every job) are queued, running or finalizing, counted up
    to `up_to` (enough to tell whether a limit is reached)."""
    active = 0
    for state in ACTIVE_STATES:
        jobs, _ = repository.list(state, limit=min(1000, up_to), tenant=tenant)
        active += len(jobs)
        if active >= up_to:
            break
    return active


def in_flight_message(tenant: str | None, limit: int) -> str:
    who = f"tenant {tenant!r}" if tenant else "this deployment"
    return f"{who} already has {limit} job(s) queued or running, the max_jobs_in_flight limit"


def plan_limit_problems(settings: Settings, plan: Sequence[ShardPlan], shard_size: int) -> list[str]:
    """One message per limit the plan is past (empty when it fits)."""
    problems = []
    rows = sum(shard.estimated_rows for shard in plan)
    if settings.max_rows_per_job is not None and rows > settings.max_rows_per_job:
        about = "" if all(shard.rows_exact for shard in plan) else "about "
        problems.append(f"the input has {about}{rows:,} rows; this deployment takes at most "
                        f"{settings.max_rows_per_job:,} per job (max_rows_per_job): split it")
    if settings.max_shards_per_job is not None and len(plan) > settings.max_shards_per_job:
        problems.append(f"the job plans into {len(plan):,} shards of {shard_size} rows; this deployment "
                        f"takes at most {settings.max_shards_per_job:,} (max_shards_per_job): "
                        "raise shard_size")
    return problems
