"""Jobs that do not simply run through: shards delivered twice, cancel mid-job, jobs that cannot run."""

from __future__ import annotations

import hashlib
import json
import time

import pytest

from bulkinfer.jobs.names import shard_lease_key
from bulkinfer.jobs.spec import JobSpec
from bulkinfer.jobs.state.status import JobState
from bulkinfer.worker.process.context import WorkerContext
from bulkinfer.worker.shards.job_lifecycle import fail_job, plan_job
from tests.worker.conftest import INPUTS_BUCKET, JOB_TIMEOUT_S, Pipeline

pytestmark = pytest.mark.timeout(300)

QUESTIONS = ["def add(a, b):", "import sys\n", "def add(a, b, c):", "class Point:"]
MAX_TOKENS = 5


def test_a_shard_run_again_adds_no_rows_and_a_part_left_by_a_crashed_run_is_replaced(
        pipeline: Pipeline) -> None:
    lines = [json.dumps({"id": f"q{n}", "question": text}) for n, text in enumerate(QUESTIONS[:4])]
    spec = JobSpec(input_uri=pipeline.put_input("rerun.jsonl", lines), model="tiny", id_column="id",
                   prompt_column="question", sampling={"temperature": 0.0, "max_tokens": MAX_TOKENS},
                   shard_size=2)
    job_id = pipeline.repository.create(spec).job_id
    layout = pipeline.repository.layout(job_id)
    # Plan here, keeping the shard tasks, so the test decides when (and how often) each one runs.
    planned: list[tuple[int, str]] = []
    plan_job(WorkerContext(pipeline.settings), job_id, lambda _, index, queue: planned.append((index, queue)))
    assert planned == [(0, "bulkinfer.model.tiny"), (1, "bulkinfer.model.tiny")]
    # A run of shard 0 that died after writing its part but before its shard result (the commit point).
    stale = json.dumps({"id": "q0", "text": "from a run that crashed"}) + "\n"
    pipeline.repository.store.put_bytes(f"{layout.output_dir}/part-00000.jsonl", stale.encode())

    def run(index: int) -> dict:
        # ignore_result=False: the pipeline's tasks store no result unless the sender asks for one
        return pipeline.client.send_task("bulkinfer.run_shard", args=[job_id, index],
                                         queue="bulkinfer.model.tiny",
                                         ignore_result=False).get(timeout=JOB_TIMEOUT_S)

    first, again = run(0), run(0)  # delivered twice, as after a lost worker

    assert first["status"] == again["status"] == "done" and again["already_done"] is True
    running = pipeline.repository.get(job_id)
    assert (running.state, running.shards.done, running.rows.succeeded) == (JobState.RUNNING, 1, 2)
    run(1)
    status = pipeline.wait_for_end(job_id)
    assert status.state == JobState.SUCCEEDED, status.error
    records = pipeline.output_records(job_id)
    assert [record["id"] for record in records] == ["q0", "q1", "q2", "q3"]
    assert "from a run that crashed" not in [record["text"] for record in records]
    assert (status.rows.total, status.rows.succeeded, status.shards.done) == (4, 4, 2)
    # And once more after the job succeeded: nothing changes.
    manifest = pipeline.manifest(job_id)
    assert run(0)["status"] == "skipped: job is succeeded"
    finalize = pipeline.client.send_task("bulkinfer.finalize_job", args=[job_id], queue="bulkinfer.control",
                                         ignore_result=False)
    assert finalize.get(timeout=JOB_TIMEOUT_S)["status"] == "skipped: job is succeeded"
    assert pipeline.manifest(job_id) == manifest and pipeline.output_records(job_id) == records
    assert pipeline.repository.get(job_id).usage == status.usage


def test_cancel_mid_job_stops_new_rows_and_the_job_ends_cancelled(pipeline: Pipeline) -> None:
    # Long generations, so shards take a while.
    lines = [json.dumps({"question": f"def f{n}(x):"}) for n in range(24)]
    spec = JobSpec(input_uri=pipeline.put_input("long.jsonl", lines), model="tiny", prompt_column="question",
                   sampling={"temperature": 0.0, "max_tokens": 100}, shard_size=2)
    job_id = pipeline.submit(spec)
    shard_count = 12
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while pipeline.repository.get(job_id).shards.done < 1:
        assert time.monotonic() < deadline, "no shard finished"
        time.sleep(0.05)

    pipeline.repository.request_cancel(job_id)

    _until_no_shard_runs_or_waits(pipeline, job_id, shard_count)
    status = pipeline.repository.get(job_id)
    assert status.state == JobState.CANCELLED
    done = status.shards.done
    assert 1 <= done < shard_count
    assert status.rows.succeeded + status.rows.failed == 2 * done
    # Finished shards keep their parts; cancelled ones wrote none, and there is no manifest.
    layout = pipeline.repository.layout(job_id)
    store = pipeline.repository.store
    parts = [info.key for info in store.list(layout.output_dir + "/")]
    assert len(parts) == done
    assert not store.exists(layout.manifest_key)


def _until_no_shard_runs_or_waits(pipeline: Pipeline, job_id: str, shard_count: int) -> None:
    """Every ticket of the model's queue taken and no shard lease held, for a second on end."""
    redis = pipeline.repository.redis
    leases = [shard_lease_key(pipeline.repository.namespace, job_id, index) for index in range(shard_count)]
    deadline, quiet_since = time.monotonic() + JOB_TIMEOUT_S, None
    while True:
        busy = redis.llen("bulkinfer.model.tiny") or redis.exists(*leases)
        now = time.monotonic()
        quiet_since = None if busy else (quiet_since or now)
        if quiet_since is not None and now - quiet_since >= 1.0:
            return
        assert now < deadline, "the job's shards did not stop"
        time.sleep(0.05)


def test_a_job_that_fails_stops_its_other_running_shards_and_they_commit_nothing(pipeline: Pipeline) -> None:
    # Shard 0 runs long generations on the worker while shard 1 fails for good (its third failed
    # attempt fails the job): shard 0 must stop and commit nothing, or a retry cut from the failed
    # job would find its rows changed under it afterwards.
    lines = [json.dumps({"question": f"def f{n}(x):"}) for n in range(16)]
    spec = JobSpec(input_uri=pipeline.put_input("fails.jsonl", lines), model="tiny", prompt_column="question",
                   sampling={"temperature": 0.0, "max_tokens": 200, "ignore_eos": True}, shard_size=8)
    job_id = pipeline.repository.create(spec).job_id
    planned: list[tuple[int, str]] = []
    plan_job(WorkerContext(pipeline.settings), job_id, lambda _, index, queue: planned.append((index, queue)))
    assert [index for index, _ in planned] == [0, 1]
    running = pipeline.client.send_task("bulkinfer.run_shard", args=[job_id, 0], queue="bulkinfer.model.tiny",
                                         ignore_result=False)
    lease = shard_lease_key(pipeline.repository.namespace, job_id, 0)
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not pipeline.repository.redis.exists(lease):
        assert time.monotonic() < deadline, "shard 0 never started"
        time.sleep(0.02)

    fail_job(pipeline.repository, job_id, "shard 1 failed 3 time(s); last error: boom")

    assert running.get(timeout=JOB_TIMEOUT_S)["status"] == "cancelled"
    layout = pipeline.repository.layout(job_id)
    assert not pipeline.repository.store.exists(layout.shard_result_key(0))
    assert list(pipeline.repository.store.list(layout.output_dir + "/")) == []
    status = pipeline.repository.get(job_id)
    assert (status.state, status.shards.done, status.rows.succeeded) == (JobState.FAILED, 0, 0)


def test_a_retry_of_another_tenants_job_fails_at_planning_and_reads_nothing_of_it(pipeline: Pipeline) -> None:
    lines = [json.dumps({"q": "x"}), "{not json"]
    theirs = pipeline.repository.create(JobSpec(input_uri=pipeline.put_input("g.jsonl", lines), model="tiny",
                                                prompt_column="q", tenant="globex")).job_id
    # A job whose spec names globex's job as its parent (as a schedule template could make one).
    spec = JobSpec(input_uri=pipeline.put_input("a.jsonl", lines), model="tiny", prompt_column="q",
                   tenant="acme", parent_job_id=theirs)
    mine = pipeline.repository.create(spec).job_id

    outcome = plan_job(WorkerContext(pipeline.settings), mine, lambda *_: None)

    assert outcome["status"] == "failed" and "no such job of this tenant's" in outcome["error"]
    assert pipeline.repository.get(mine).state == JobState.FAILED


def test_an_unknown_model_fails_the_job_with_a_message(pipeline: Pipeline) -> None:
    spec = JobSpec(input_uri=pipeline.put_input("one.jsonl", [json.dumps({"q": "x"})]), model="gpt-9",
                   prompt_column="q")

    status = pipeline.wait_for_end(pipeline.submit(spec))

    assert status.state == JobState.FAILED
    assert "gpt-9" in status.error and "tiny" in status.error


def test_an_unreadable_input_fails_the_job_with_a_message(pipeline: Pipeline) -> None:
    spec = JobSpec(input_uri=f"s3://{INPUTS_BUCKET}/nowhere.jsonl", model="tiny", prompt_column="q")

    status = pipeline.wait_for_end(pipeline.submit(spec))

    assert status.state == JobState.FAILED
    assert "cannot read the input" in status.error and "nowhere.jsonl" in status.error


@pytest.mark.parametrize(("schema", "reason"), [
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "Cannot find field '$defs'"),
    ({"type": "object", "not": {"required": ["a"]}}, "'not' is not enforced"),
])
def test_a_job_schema_that_cannot_compile_fails_the_job_at_plan_not_every_row(
        pipeline: Pipeline, schema: dict, reason: str) -> None:
    lines = [json.dumps({"q": f"row {n}"}) for n in range(5)]
    spec = JobSpec(input_uri=pipeline.put_input("schema.jsonl", lines), model="tiny", prompt_column="q",
                   response_format={"type": "json_schema", "json_schema": {"name": "out", "schema": schema}})

    status = pipeline.wait_for_end(pipeline.submit(spec))

    assert status.state == JobState.FAILED and status.shards.total == 0  # no shard ever ran
    assert status.error.startswith("response_format: grammar for json_schema failed to compile")
    assert reason in status.error


def test_a_model_whose_files_are_missing_fails_the_job_from_its_shard(pipeline: Pipeline) -> None:
    spec = JobSpec(input_uri=pipeline.put_input("one.jsonl", [json.dumps({"q": "x"})]), model="missing",
                   prompt_column="q")

    status = pipeline.wait_for_end(pipeline.submit(spec))

    assert status.state == JobState.FAILED
    assert "cannot load model 'missing'" in status.error and "no-such-model" in status.error


def test_an_empty_input_succeeds_with_no_rows(pipeline: Pipeline) -> None:
    spec = JobSpec(input_uri=pipeline.put_input("empty.jsonl", []), model="tiny", prompt_column="q")

    status = pipeline.wait_for_end(pipeline.submit(spec))

    assert status.state == JobState.SUCCEEDED, status.error
    assert (status.rows.total, status.shards.done, status.shards.total) == (0, 1, 1)
    assert pipeline.output_records(status.job_id) == []


def test_a_shard_delivered_twice_at_once_runs_once(pipeline: Pipeline) -> None:
    # Random sampling without a seed: two runs would write different bytes, so only one may write.
    lines = [json.dumps({"question": f"def f{n}(x):"}) for n in range(4)]
    spec = JobSpec(input_uri=pipeline.put_input("twice.jsonl", lines), model="tiny", prompt_column="question",
                   sampling={"temperature": 1.0, "max_tokens": 60}, shard_size=2)
    job_id = pipeline.repository.create(spec).job_id
    planned: list[int] = []
    plan_job(WorkerContext(pipeline.settings), job_id, lambda _, index, queue: planned.append(index))

    both = [pipeline.client.send_task("bulkinfer.run_shard", args=[job_id, 0], queue="bulkinfer.model.tiny",
                                      ignore_result=False)
            for _ in range(2)]  # the worker's two threads take one each
    outcomes = [result.get(timeout=JOB_TIMEOUT_S) for result in both]

    assert sorted(outcome["already_done"] for outcome in outcomes) == [False, True]
    layout = pipeline.repository.layout(job_id)
    result = json.loads(pipeline.repository.store.get_bytes(layout.shard_result_key(0)))
    part = pipeline.repository.store.get_bytes(result["output"]["key"])
    assert hashlib.sha256(part).hexdigest() == result["output"]["sha256"]
    assert pipeline.repository.get(job_id).shards.done == 1
