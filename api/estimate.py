"""`POST /jobs` with `"dry_run": true`: everything a submit checks, then an estimate instead of a job
(jobs/estimate.py): rows, prompt tokens by the model's own tokenizer, shared-prefix tokens, maximum
output tokens, rows that would be deduplicated, and a run time from this deployment's measured
throughput for the model."""

from __future__ import annotations

from api.dependencies import ApiContext
from jobs.estimate import estimate_job
from jobs.estimate_report import JobEstimate
from jobs.object_store.base import ObjectStore
from jobs.sharding import plan_shards
from jobs.spec import JobSpec
from jobs.tokenizer_files import load_tokenizer
from jobs.workers import MIN_MEASURED_BUSY_S, Throughput, last_throughput, live_workers


def estimate_spec(context: ApiContext, spec: JobSpec, store: ObjectStore, key: str) -> JobEstimate:
    """The estimate for a validated, resolved spec whose input is at `store`/`key`."""
    repository = context.repository
    plan = plan_shards(store, key, spec)
    tokenizer = load_tokenizer(repository.store, repository.prefix, spec.model)
    measured, live = _throughput(context, spec.model)
    estimate = estimate_job(store, key, spec, plan, tokenizer, measured, live)
    return estimate.model_copy(update={"problems": _limit_problems(context, estimate)})


def _throughput(context: ApiContext, model: str) -> tuple[list[Throughput], int]:
    """The live workers' measurements of `model` (else the last one recorded) and how many live
    workers have it loaded."""
    repository = context.repository
    measured, live = [], 0
    for beat in live_workers(repository.redis, repository.namespace):
        for hosted in beat.models:
            if hosted.name != model or hosted.state != "loaded":
                continue
            live += 1
            if hosted.busy_s >= MIN_MEASURED_BUSY_S and hosted.tokens_computed:
                rate = hosted.tokens_computed / hosted.busy_s
                measured.append(Throughput(model=model, tokens_per_busy_s=rate, busy_s=hosted.busy_s,
                                           hostname=beat.hostname, dtype=hosted.dtype, device=hosted.device,
                                           measured_at=beat.updated_at))
    if not measured and (last := last_throughput(repository.redis, repository.namespace, model)) is not None:
        measured.append(last)
    return measured, live


def _limit_problems(context: ApiContext, estimate: JobEstimate) -> list[str]:
    """What would fail the job at planning (the deployment's row and shard limits)."""
    settings, problems = context.settings, []
    if settings.max_rows_per_job is not None and estimate.rows > settings.max_rows_per_job:
        problems.append(f"the input has {estimate.rows:,} rows; this deployment takes at most "
                        f"{settings.max_rows_per_job:,} per job (max_rows_per_job)")
    if settings.max_shards_per_job is not None and estimate.shards > settings.max_shards_per_job:
        problems.append(f"the job plans into {estimate.shards:,} shards; this deployment takes at most "
                        f"{settings.max_shards_per_job:,} (max_shards_per_job)")
    return problems
