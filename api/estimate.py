"""`POST /jobs` with `"dry_run": true`: everything a submit checks, then an estimate instead of a job
(jobs/planning/estimate.py): rows, prompt tokens by the model's own tokenizer, shared-prefix tokens, maximum
output tokens, rows that would be deduplicated, and a run time from this deployment's measured
throughput for the model."""

from __future__ import annotations

from bulkinfer.api.dependencies import ApiContext
from bulkinfer.jobs.limits import plan_limit_problems
from bulkinfer.jobs.object_store.base import ObjectStore
from bulkinfer.jobs.output_tokens import OutputLengths, expected_output_tokens
from bulkinfer.jobs.planning.estimate import estimate_job
from bulkinfer.jobs.planning.estimate_report import JobEstimate
from bulkinfer.jobs.planning.shard_cost import plan_within_bounds
from bulkinfer.jobs.spec import JobSpec
from bulkinfer.jobs.tokenizer_files import load_tokenizer
from bulkinfer.jobs.workers import Throughput, last_throughput, live_workers, measured_throughput


def estimate_spec(context: ApiContext, spec: JobSpec, store: ObjectStore, key: str) -> JobEstimate:
    """The estimate for a validated, resolved spec whose input is at `store`/`key`."""
    repository, settings = context.repository, context.settings
    expected = expected_output_tokens(repository.redis, repository.namespace, spec.model,
                                      settings.output_estimate)
    plan = plan_within_bounds(settings, store, key, spec, expected)
    tokenizer = load_tokenizer(repository.store, repository.prefix, spec.model)
    measured, live = _throughput(context, spec.model)
    estimate = estimate_job(store, key, spec, plan, tokenizer, measured, live, registry=context.registry,
                            output_lengths=OutputLengths(expected, settings.tokens_cap))
    problems = plan_limit_problems(settings, plan, min(spec.shard_size, settings.max_shard_size))
    return estimate.model_copy(update={"problems": problems})


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
            if (reading := measured_throughput(beat, hosted)) is not None:
                measured.append(reading)
    if not measured and (last := last_throughput(repository.redis, repository.namespace, model)) is not None:
        measured.append(last)
    return measured, live
