"""Live counters count each shard once; the manifest is the same however often it is built."""

from __future__ import annotations

import json

import pytest
import redis

from bulkinfer.jobs.layout import JobLayout
from bulkinfer.jobs.object_store import AlreadyExists
from bulkinfer.jobs.planning.sharding import plan_shards
from bulkinfer.jobs.spec import JobSpec
from bulkinfer.jobs.state.counters import CountersMissing, JobCounters
from bulkinfer.jobs.state.manifest import IncompleteJob, build_manifest, read_manifest, write_manifest
from bulkinfer.jobs.state.results import load_shard_results, save_shard_result
from tests.jobs.helpers import run_shard

ROWS = 53


@pytest.fixture
def job(store):
    """A JSONL job of 53 rows (every 10th unrunnable), its plan's row counts off by one per shard, as
    a plan saved before JSONL counts were exact (or a retry's) may be: the results' counts win."""
    lines = [json.dumps({"q": f"question {n} " + "x" * (n % 7)} if n % 10 else {"other": n})
             for n in range(ROWS)]
    store.put_bytes("in/rows.jsonl", ("\n".join(lines) + "\n").encode())
    spec = JobSpec(input_uri="/in/rows.jsonl", input_format="jsonl", output_format="jsonl", model="m",
                   prompt_column="q", shard_size=10)
    layout = JobLayout("job-1", prefix="tenant-a")
    plan = [shard.model_copy(update={"estimated_rows": shard.estimated_rows + 1, "rows_exact": False})
            for shard in plan_shards(store, "in/rows.jsonl", spec)]
    return store, spec, layout, plan


def test_each_shard_is_counted_once_even_when_reported_twice(job, redis_url) -> None:
    store, spec, layout, plan = job
    counters = JobCounters(redis.Redis.from_url(redis_url), layout.job_id)
    with pytest.raises(CountersMissing):
        counters.read()
    assert not plan[0].rows_exact
    assert counters.initialize(plan) is True
    assert counters.initialize(plan) is False  # a retried submit leaves the counters alone
    assert counters.read().shards.total == len(plan)
    assert counters.read().rows.total == sum(shard.estimated_rows for shard in plan) != ROWS

    results = [run_shard(store, "in/rows.jsonl", store, layout, spec, shard) for shard in plan]
    for result in results:
        assert counters.apply_shard(result) is True
    for result in results:  # the same shards delivered again
        assert counters.apply_shard(result) is False

    snapshot = counters.read()
    assert snapshot.rows.total == ROWS  # estimates replaced by the real counts
    assert (snapshot.rows.succeeded, snapshot.rows.failed, snapshot.rows.pending) == (ROWS - 6, 6, 0)
    assert (snapshot.shards.done, snapshot.shards.total) == (len(plan), len(plan))
    assert snapshot.usage.prompt == sum(result.usage.prompt for result in results) > 0


def test_applying_to_lost_counters_asks_for_a_rebuild(job, redis_url) -> None:
    store, spec, layout, plan = job
    counters = JobCounters(redis.Redis.from_url(redis_url), layout.job_id)
    result = run_shard(store, "in/rows.jsonl", store, layout, spec, plan[0])
    with pytest.raises(CountersMissing):
        counters.apply_shard(result)


def test_counters_are_rebuilt_from_the_store_after_redis_loses_them(job, redis_url) -> None:
    store, spec, layout, plan = job
    client = redis.Redis.from_url(redis_url)
    counters = JobCounters(client, layout.job_id)
    counters.initialize(plan)
    done = [run_shard(store, "in/rows.jsonl", store, layout, spec, shard) for shard in plan[:3]]
    for result in done:
        counters.apply_shard(result)
    before = counters.read()
    client.flushall()

    rebuilt = counters.rebuild_from_store(store, layout, plan)
    assert rebuilt == before
    assert all(counters.apply_shard(result) is False for result in done)  # still counted once
    for shard in plan[3:]:
        assert counters.apply_shard(run_shard(store, "in/rows.jsonl", store, layout, spec, shard)) is True
    assert counters.read().rows.pending == 0 and counters.read().rows.total == ROWS

    results = load_shard_results(store, layout)
    manifest = build_manifest(layout.job_id, spec.spec_hash(), "jsonl", len(plan), results)
    write_manifest(store, layout, manifest)
    client.flushall()
    from_manifest = counters.rebuild_from_store(store, layout, plan)
    assert from_manifest.rows == manifest.rows and from_manifest.usage == manifest.usage


def test_the_manifest_is_identical_however_often_it_is_built(job) -> None:
    store, spec, layout, plan = job
    results = [run_shard(store, "in/rows.jsonl", store, layout, spec, shard) for shard in plan]
    stored = load_shard_results(store, layout)
    assert stored == results

    first = build_manifest(layout.job_id, spec.spec_hash(), "jsonl", len(plan), stored)
    shuffled_with_repeats = list(reversed(stored)) + stored
    second = build_manifest(layout.job_id, spec.spec_hash(), "jsonl", len(plan), shuffled_with_repeats)
    assert first.to_bytes() == second.to_bytes()
    assert write_manifest(store, layout, first) is True
    assert write_manifest(store, layout, second) is False  # a finalize that runs twice is fine
    assert read_manifest(store, layout) == first

    assert first.rows.total == ROWS and first.rows.failed == 6
    assert [part.first_row for part in first.parts] == [sum(r.rows for r in results[:i])
                                                        for i in range(len(plan))]
    for part in first.parts:
        location_key = f"tenant-a/jobs/job-1/output/part-{part.shard_index:05d}.jsonl"
        assert part.output.key == location_key and part.output.bytes == store.head(location_key).size
    assert first.timings.shard_seconds == 2.0 * len(plan)


def test_a_different_manifest_cannot_replace_the_first(job) -> None:
    store, spec, layout, plan = job
    results = [run_shard(store, "in/rows.jsonl", store, layout, spec, shard) for shard in plan]
    write_manifest(store, layout, build_manifest("job-1", "hash-a", "jsonl", len(plan), results))
    with pytest.raises(AlreadyExists):
        write_manifest(store, layout, build_manifest("job-1", "hash-b", "jsonl", len(plan), results))


def test_the_manifest_waits_for_every_shard(job) -> None:
    store, spec, layout, plan = job
    results = [run_shard(store, "in/rows.jsonl", store, layout, spec, shard) for shard in plan[1:]]
    with pytest.raises(IncompleteJob, match=r"missing: \[0\]"):
        build_manifest("job-1", "h", "jsonl", len(plan), results)
    altered = results[0].model_copy(update={"rows_failed": 99})
    with pytest.raises(IncompleteJob, match="two different results"):
        build_manifest("job-1", "h", "jsonl", len(plan), [*results, altered])


def test_a_shard_result_is_written_once_and_the_first_one_stands(job) -> None:
    store, spec, layout, plan = job
    first = run_shard(store, "in/rows.jsonl", store, layout, spec, plan[0])
    rerun = first.model_copy(update={"rows_succeeded": 0})
    assert save_shard_result(store, layout, rerun) == first



def test_speculation_counts_add_up_from_rows_to_shards_to_the_manifest(job, monkeypatch) -> None:
    """Each computed row's drafts and acceptances per draft position are summed into its shard's
    result and the job's manifest, with the rates derived; deduplicated copies count nothing."""
    import dataclasses

    import tests.jobs.helpers as helpers

    echo = helpers.echo_output
    copies = []

    def speculating_echo(row):
        # Every row verified drafts twice: 3 drafts (2 accepted), then 1 draft (accepted).
        copy = row.index % 7 == 0
        copies.append(copy)
        return dataclasses.replace(echo(row), drafted_per_position=(2, 1, 1), accepted_per_position=(2, 1),
                                   deduplicated=copy)

    monkeypatch.setattr(helpers, "echo_output", speculating_echo)
    store, spec, layout, plan = job
    results = [run_shard(store, "in/rows.jsonl", store, layout, spec, shard) for shard in plan]
    assert load_shard_results(store, layout) == results  # the counts survive the store
    rows = copies.count(False)
    speculation = build_manifest(layout.job_id, spec.spec_hash(), "jsonl", len(plan), results).speculation
    assert speculation is not None and 0 < rows < len(copies)
    assert speculation.drafted_per_position == [2 * rows, rows, rows]
    assert speculation.accepted_per_position == [2 * rows, rows]
    assert speculation.draft_tokens == 4 * rows and speculation.accepted_tokens == 3 * rows
    assert speculation.acceptance_rate == 0.75
    assert speculation.acceptance_rate_per_position == [1.0, 1.0, 0.0]
    assert speculation.mean_accepted_length == 2.5  # (3 accepted + 2 added tokens) / 2 verifications
    manifest = build_manifest(layout.job_id, spec.spec_hash(), "jsonl", len(plan), results)
    assert json.loads(manifest.to_bytes())["speculation"]["mean_accepted_length"] == 2.5


def test_a_job_without_drafts_has_no_speculation_section(job) -> None:
    store, spec, layout, plan = job
    results = [run_shard(store, "in/rows.jsonl", store, layout, spec, shard) for shard in plan]
    assert build_manifest(layout.job_id, spec.spec_hash(), "jsonl", len(plan), results).speculation is None
