"""Moving a job through the pipeline with the real jobs/ code and the echo engine of the jobs tests,
for API tests that need a running or finished job without a worker process."""

from __future__ import annotations

from bulkinfer.jobs.object_store.factory import store_for_uri
from bulkinfer.jobs.planning.sharding import plan_shards
from bulkinfer.jobs.state.manifest import build_manifest, write_manifest
from bulkinfer.jobs.state.repository import JobRepository
from bulkinfer.jobs.state.results import load_shard_results
from bulkinfer.jobs.state.status import JobState
from tests.jobs.helpers import run_shard


def start(repository: JobRepository, job_id: str) -> None:
    """What plan_job does: plan, count, run."""
    spec = repository.get_spec(job_id)
    store, key = store_for_uri(spec.input_uri)
    plan = repository.save_plan(job_id, plan_shards(store, key, spec))
    repository.counters(job_id).initialize(plan)
    repository.transition(job_id, JobState.RUNNING)


def run_shards(repository: JobRepository, job_id: str, count: int | None = None) -> None:
    """What run_shard does for the first `count` shards (all by default)."""
    spec = repository.get_spec(job_id)
    store, key = store_for_uri(spec.input_uri)
    plan = repository.load_plan(job_id)
    for shard in plan[:count]:
        result = run_shard(store, key, repository.store, repository.layout(job_id), spec, shard)
        repository.counters(job_id).apply_shard(result)


def finish(repository: JobRepository, job_id: str) -> None:
    """Plan, run every shard, write the manifest and succeed: the whole pipeline, echoing rows."""
    start(repository, job_id)
    run_shards(repository, job_id)
    spec = repository.get_spec(job_id)
    layout = repository.layout(job_id)
    repository.transition(job_id, JobState.FINALIZING)
    results = load_shard_results(repository.store, layout)
    manifest = build_manifest(job_id, spec.spec_hash(), spec.effective_output_format.value,
                              len(repository.load_plan(job_id)), results)
    write_manifest(repository.store, layout, manifest)
    repository.transition(job_id, JobState.SUCCEEDED)
