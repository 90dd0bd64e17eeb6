"""Schedules and their tick against real Redis and a local store; the clock is passed in."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import redis
from pydantic import ValidationError

from bulkinfer.jobs.object_store import LocalObjectStore
from bulkinfer.jobs.scheduling.schedule_tick import is_due, tick_due, tick_schedule
from bulkinfer.jobs.scheduling.schedules import (
    Schedule,
    ScheduleNotFound,
    ScheduleRepository,
    ScheduleSpec,
    idempotency_key,
    matches,
    split_input,
)
from bulkinfer.jobs.spec import InputFormat, validation_messages
from bulkinfer.jobs.state.repository import JobRepository
from bulkinfer.jobs.state.status import JobState
from tests.fixtures.services import REPO_ROOT

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
JOB = {"model": "tiny", "prompt_column": "q", "sampling": {"max_tokens": 4}}


@pytest.fixture
def jobs(tmp_path, redis_url) -> JobRepository:
    return JobRepository(LocalObjectStore(tmp_path / "store"), redis.Redis.from_url(redis_url))


@pytest.fixture
def schedules(jobs) -> ScheduleRepository:
    return ScheduleRepository.beside(jobs)


@pytest.fixture
def inbox(tmp_path) -> Path:
    path = tmp_path / "inbox"
    path.mkdir()
    return path


class Planner:
    """Stands in for `bulkinfer.plan_job`: records the jobs it was asked to plan."""

    def __init__(self) -> None:
        self.sent: list[str] = []

    def __call__(self, job_id: str) -> None:
        self.sent.append(job_id)


def put(inbox: Path, name: str, rows: int = 1) -> None:
    (inbox / name).write_text("".join(f'{{"q": "row {n}"}}\n' for n in range(rows)))


def make(schedules: ScheduleRepository, inbox: Path, **changes) -> Schedule:
    fields = {"cron": "*/5 * * * *", "input_prefix": f"{inbox}/", "job": JOB}
    return schedules.create(ScheduleSpec(**{**fields, **changes}))


def all_jobs(jobs: JobRepository) -> list:
    return jobs.list(limit=1000)[0]


def errors(**fields) -> list[str]:
    base = {"cron": "* * * * *", "input_prefix": "s3://b/in/", "job": JOB}
    with pytest.raises(ValidationError) as caught:
        ScheduleSpec(**{**base, **fields})
    return validation_messages(caught.value)


# -- validation -----------------------------------------------------------------------------------


def test_a_bad_cron_is_refused_naming_the_expression_and_the_problem() -> None:
    assert errors(cron="61 * * * *") == [
        "cron: '61 * * * *' is not a valid cron expression: [61 * * * *] is not acceptable, out of range"]
    assert "it has 3 fields" in errors(cron="* * *")[0]


def test_cron_takes_five_fields_or_six_with_seconds() -> None:
    assert ScheduleSpec(cron="0  * * * *", input_prefix="s3://b/", job=JOB).cron == "0 * * * *"
    assert ScheduleSpec(cron="* * * * * */2", input_prefix="s3://b/", job=JOB).cron == "* * * * * */2"


def test_the_job_template_is_checked_as_a_job_spec_without_its_per_object_fields() -> None:
    assert errors(job={**JOB, "input_uri": "s3://b/x.jsonl"}) == [
        "job: input_uri: set per input object by the schedule; leave it out"]
    assert errors(job={**JOB, "sampling": {"temperature": -1}}) == [
        "job: sampling.temperature: Input should be greater than or equal to 0"]
    assert errors(job={"prompt_column": "q"}) == ["job: model: Field required"]
    assert errors(webhook_url="ftp://example.com/x") == [
        "webhook_url: must be an http:// or https:// URL, got 'ftp://example.com/x'"]
    [shared_output] = errors(job={**JOB, "output_uri": "s3://b/out/"})
    assert shared_output.startswith("job: output_uri: every job a schedule submits writes to its own folder")
    too_many = {f"k{n}": "v" for n in range(16)}  # the schedule id takes the 17th place
    assert "at most 16" in errors(job={**JOB, "metadata": too_many})[0]


def test_a_glob_lists_its_literal_prefix_and_matches_whole_keys() -> None:
    assert split_input("s3://b/in/") == ("s3://b/in/", None)
    assert split_input("s3://b/in/*.jsonl") == ("s3://b/in/", "in/*.jsonl")
    assert split_input("/data/in/day-??.parquet") == ("/data/in/day-", "data/in/day-??.parquet")
    assert matches("in/*.jsonl", "in/a.jsonl") and matches("in/*.jsonl", "in/deep/a.jsonl")
    assert not matches("in/*.jsonl", "in/a.parquet")


def test_the_job_for_an_object_is_keyed_by_schedule_key_and_etag(schedules, inbox) -> None:
    schedule = make(schedules, inbox, webhook_url="https://example.com/hook")
    spec = schedule.job_spec("s3://b/in/a.jsonl", "in/a.jsonl", '"e1"')
    assert spec.idempotency_key == idempotency_key(schedule.id, "in/a.jsonl", '"e1"')
    assert spec.idempotency_key != idempotency_key(schedule.id, "in/a.jsonl", '"e2"')
    assert spec.metadata == {"schedule_id": schedule.id}
    assert spec.webhook_url == "https://example.com/hook"
    assert len(idempotency_key(schedule.id, "k" * 1024, "e")) <= 256


# -- the repository ---------------------------------------------------------------------------------


def test_schedules_are_stored_listed_paused_and_deleted(schedules, inbox) -> None:
    first, second = make(schedules, inbox, name="first"), make(schedules, inbox, paused=True)
    assert [s.id for s in schedules.list()] == [first.id, second.id]
    assert schedules.get(first.id) == first
    assert schedules.set_paused(first.id, True).paused and schedules.get(first.id).paused
    assert schedules.runtime(schedules.get(first.id)).next_tick_at is None
    schedules.delete(first.id)
    with pytest.raises(ScheduleNotFound):
        schedules.get(first.id)
    with pytest.raises(ScheduleNotFound):
        schedules.get("../../jobs/x")
    assert [s.id for s in schedules.list()] == [second.id]


# -- due or not, by an injected clock ---------------------------------------------------------------


def test_a_schedule_is_due_when_its_cron_fired_since_its_last_tick(schedules, jobs, inbox) -> None:
    schedule = make(schedules, inbox).model_copy(update={"created_at": T0})
    assert not is_due(schedules, schedule, T0 + timedelta(minutes=4, seconds=59))
    assert is_due(schedules, schedule, T0 + timedelta(minutes=5))
    tick_schedule(schedules, jobs, schedule, Planner(), now=T0 + timedelta(minutes=7))
    assert not is_due(schedules, schedule, T0 + timedelta(minutes=9))
    assert is_due(schedules, schedule, T0 + timedelta(minutes=10))
    assert schedules.runtime(schedule).next_tick_at == T0 + timedelta(minutes=10)
    paused = schedule.model_copy(update={"paused": True})
    assert not is_due(schedules, paused, T0 + timedelta(hours=1))


def test_tick_due_ticks_only_the_due_schedules(schedules, jobs, inbox) -> None:
    put(inbox, "a.jsonl")
    due = make(schedules, inbox, cron="* * * * *")
    make(schedules, inbox, cron="0 0 1 1 *")  # once a year: not due a minute after creation
    make(schedules, inbox, cron="* * * * *", paused=True)
    results = tick_due(schedules, jobs, Planner(), now=due.created_at + timedelta(minutes=1))
    assert [result.schedule_id for result in results] == [due.id]
    assert [item.key.rsplit("/", 1)[1] for item in results[0].submitted] == ["a.jsonl"]


# -- exactly one job per object ---------------------------------------------------------------------


def test_repeated_ticks_over_files_that_appear_over_time_make_one_job_per_file(
        schedules, jobs, inbox) -> None:
    schedule = make(schedules, inbox)
    planner = Planner()
    assert tick_schedule(schedules, jobs, schedule, planner).submitted == []
    put(inbox, "a.jsonl")
    first = tick_schedule(schedules, jobs, schedule, planner)
    put(inbox, "b.jsonl", rows=2)
    (inbox / "empty.jsonl").touch()  # still being written: left for a later tick
    for _ in range(3):
        tick_schedule(schedules, jobs, schedule, planner)

    submitted = schedules.submitted(schedule.id)
    assert [item.key.rsplit("/", 1)[1] for item in submitted] == ["a.jsonl", "b.jsonl"]
    assert [item.job_id for item in first.submitted] == [submitted[0].job_id]
    assert sorted(job.job_id for job in all_jobs(jobs)) == sorted(item.job_id for item in submitted)
    assert planner.sent == [item.job_id for item in submitted]  # each job planned once
    spec = jobs.get_spec(submitted[1].job_id)
    assert spec.input_uri == f"file://{inbox}/b.jsonl"
    assert spec.input_format == InputFormat.JSONL  # resolved at submit, as POST /jobs does
    assert schedules.runtime(schedule).jobs_submitted == 2


def test_a_restarted_scheduler_that_forgot_what_it_submitted_submits_nothing_twice(
        schedules, jobs, inbox) -> None:
    schedule = make(schedules, inbox)
    put(inbox, "a.jsonl")
    put(inbox, "b.jsonl")
    before = [item.job_id for item in tick_schedule(schedules, jobs, schedule, Planner()).submitted]
    jobs.transition(before[0], JobState.RUNNING)  # the first job is under way

    schedules.redis.delete(f"bulkinfer:schedule:{{{schedule.id}}}:seen")  # Redis lost the record
    planner = Planner()
    again = tick_schedule(schedules, jobs, schedule, planner)

    assert [item.job_id for item in again.submitted] == before  # found again, not created
    assert len(all_jobs(jobs)) == 2
    assert planner.sent == [before[1]]  # only the job still queued is planned again (plan is idempotent)


def test_a_changed_object_is_new_input_and_gets_a_new_job(schedules, jobs, inbox) -> None:
    schedule = make(schedules, inbox)
    put(inbox, "a.jsonl")
    first = tick_schedule(schedules, jobs, schedule, Planner()).submitted
    put(inbox, "a.jsonl", rows=3)
    stat = (inbox / "a.jsonl").stat()
    os.utime(inbox / "a.jsonl", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # a new ETag
    second = tick_schedule(schedules, jobs, schedule, Planner()).submitted
    assert len(first) == len(second) == 1 and first[0].job_id != second[0].job_id
    assert len(all_jobs(jobs)) == 2


def test_a_glob_submits_only_matching_objects(schedules, jobs, inbox) -> None:
    schedule = make(schedules, inbox, input_prefix=f"{inbox}/*.jsonl")
    put(inbox, "a.jsonl")
    (inbox / "_SUCCESS").write_text("marker")
    submitted = tick_schedule(schedules, jobs, schedule, Planner()).submitted
    assert [item.key.rsplit("/", 1)[1] for item in submitted] == ["a.jsonl"]


def test_an_unreadable_prefix_is_recorded_on_the_schedule(schedules, jobs, tmp_path) -> None:
    schedule = schedules.create(ScheduleSpec(cron="* * * * *", input_prefix="s3://no-such-bucket/in/",
                                             job=JOB))
    result = tick_schedule(schedules, jobs, schedule, Planner(), endpoint_url="http://127.0.0.1:9")
    assert result.submitted == [] and result.error
    assert schedules.runtime(schedule).last_error == result.error


def test_a_tick_submits_at_most_its_limit_and_the_next_tick_the_rest(schedules, jobs, inbox) -> None:
    schedule = make(schedules, inbox)
    for name in ("a", "b", "c"):
        put(inbox, f"{name}.jsonl")
    assert len(tick_schedule(schedules, jobs, schedule, Planner(), limit=2).submitted) == 2
    assert len(tick_schedule(schedules, jobs, schedule, Planner(), limit=2).submitted) == 1
    assert len(all_jobs(jobs)) == 3


def test_the_sdk_reads_schedules_back_without_croniter_or_redis() -> None:
    """croniter and redis belong to the server extra; `client.schedules` must work without them."""
    probe = ("import sys; sys.modules['croniter'] = None; sys.modules['redis'] = None\n"
             "from bulkinfer.jobs.scheduling.schedules import ScheduleView\n"
             "view = ScheduleView.model_validate({'id': 'sched-' + '0' * 32,"
             " 'created_at': '2026-01-01T00:00:00Z', 'cron': '*/5  * * * *', 'input_prefix': 's3://b/in/',"
             " 'job': {'model': 'm', 'prompt_column': 'q'}, 'runtime': {}})\n"
             "print(view.cron)")
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "*/5 * * * *"
