"""The job status machine."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from bulkinfer.jobs.state.status import (
    ALLOWED_TRANSITIONS,
    IllegalTransition,
    JobState,
    JobStatus,
    RowCounts,
    check_transition,
)

LEGAL = {
    ("queued", "running"), ("queued", "failed"), ("queued", "cancelled"),
    ("running", "finalizing"), ("running", "failed"), ("running", "cancelled"),
    ("finalizing", "succeeded"), ("finalizing", "failed"), ("finalizing", "cancelled"),
    # A deadline: a job never planned expires at once; a running one through finalize (its manifest).
    ("queued", "expired"), ("finalizing", "expired"),
}


@pytest.mark.parametrize("current", list(JobState))
@pytest.mark.parametrize("target", list(JobState))
def test_exactly_the_documented_transitions_are_allowed(current, target) -> None:
    if (current.value, target.value) in LEGAL:
        check_transition(current, target)
    else:
        with pytest.raises(IllegalTransition):
            check_transition(current, target)


def test_illegal_transitions_say_what_was_allowed() -> None:
    with pytest.raises(IllegalTransition, match="a succeeded job cannot become running \\(allowed: none"):
        check_transition(JobState.SUCCEEDED, JobState.RUNNING)
    with pytest.raises(IllegalTransition, match="a queued job cannot become succeeded \\(allowed: cancelled, "
                                                "expired, failed, running\\)"):
        check_transition(JobState.QUEUED, JobState.SUCCEEDED)
    assert all(not ALLOWED_TRANSITIONS[state] for state in JobState if state.is_terminal)


def test_a_job_runs_through_its_lifecycle_with_timestamps() -> None:
    t = [datetime(2026, 1, 1, hour, tzinfo=UTC) for hour in range(4)]
    status = JobStatus(job_id="j1", created_at=t[0])
    status = status.transition(JobState.RUNNING, at=t[1])
    status = status.transition(JobState.FINALIZING, at=t[2]).transition(JobState.SUCCEEDED, at=t[3])
    assert (status.state, status.started_at, status.finished_at) == (JobState.SUCCEEDED, t[1], t[3])
    with pytest.raises(IllegalTransition):
        status.transition(JobState.CANCELLED)


def test_a_failed_job_must_say_why() -> None:
    with pytest.raises(ValueError, match="needs an error message"):
        JobStatus(job_id="j1").transition(JobState.FAILED)
    failed = JobStatus(job_id="j1").transition(JobState.FAILED, error="input unreadable: not Parquet")
    assert failed.error == "input unreadable: not Parquet" and failed.finished_at is not None


def test_row_counts_report_pending_rows() -> None:
    counts = RowCounts(total=10, succeeded=6, failed=1)
    assert counts.pending == 3
    assert counts.model_dump() == {"total": 10, "succeeded": 6, "failed": 1, "deduplicated": 0, "pending": 3}
