"""The deployment's per-job limits a plan must fit (max_rows_per_job, max_shards_per_job): the planner
fails a job past them, and a dry run reports them."""

from __future__ import annotations

from collections.abc import Sequence

from jobs.settings import Settings
from jobs.sharding import ShardPlan


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
