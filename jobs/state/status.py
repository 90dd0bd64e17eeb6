"""The job status machine and the status a client sees.

    queued → running → finalizing → succeeded | expired (its completion_window passed)
       └──────┴───────────┴──────→ failed | cancelled
    queued ─────────────────────→ expired (never planned before its deadline)
"""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, computed_field

from bulkinfer.jobs.state.results import TokenUsage


class JobState(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    FINALIZING = "finalizing"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"  # its completion_window passed: the rows not done by then are `expired` errors

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED, JobState.EXPIRED})
# Ends with results (a manifest): every row has an outcome, `expired` ones included.
COMPLETED_STATES = frozenset({JobState.SUCCEEDED, JobState.EXPIRED})
ALLOWED_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.RUNNING, JobState.FAILED, JobState.CANCELLED, JobState.EXPIRED}),
    JobState.RUNNING: frozenset({JobState.FINALIZING, JobState.FAILED, JobState.CANCELLED}),
    JobState.FINALIZING: frozenset({JobState.SUCCEEDED, JobState.EXPIRED, JobState.FAILED,
                                    JobState.CANCELLED}),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
    JobState.EXPIRED: frozenset(),
}


class IllegalTransition(ValueError):
    def __init__(self, current: JobState, target: JobState) -> None:
        allowed = ", ".join(sorted(ALLOWED_TRANSITIONS[current])) or "none: it is final"
        super().__init__(f"a {current.value} job cannot become {target.value} (allowed: {allowed})")
        self.current = current
        self.target = target


def check_transition(current: JobState, target: JobState) -> None:
    """Raise `IllegalTransition` unless `current → target` is an edge of the machine."""
    if target not in ALLOWED_TRANSITIONS[current]:
        raise IllegalTransition(current, target)


class RowCounts(BaseModel):
    """`total` is exact once every shard is done; before that it may rest on the plan's estimate."""

    total: int = 0
    succeeded: int = 0
    failed: int = 0
    # Of the finished rows: how many took an identical deterministic row's output instead of running.
    deduplicated: int = 0

    @computed_field  # type: ignore[prop-decorator]
    @property
    def pending(self) -> int:
        return max(0, self.total - self.succeeded - self.failed)


class ShardCounts(BaseModel):
    done: int = 0
    total: int = 0


class JobStatus(BaseModel):
    """What `GET /jobs/<id>` returns. Change the state only through `transition`."""

    model_config = ConfigDict(frozen=True)

    job_id: str
    state: JobState = JobState.QUEUED
    rows: RowCounts = Field(default_factory=RowCounts)
    shards: ShardCounts = Field(default_factory=ShardCounts)
    usage: TokenUsage = Field(default_factory=TokenUsage)
    created_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    started_at: datetime | None = None
    finalizing_at: datetime | None = Field(None, description="when its finished shards' parts began to be "
                                           "merged and published (the `finalizing` state)")
    finished_at: datetime | None = None
    output_uris: list[str] = Field(default_factory=list)
    manifest_uri: str | None = None
    error: str | None = Field(None, description="why the job failed")
    tenant: str | None = Field(None, description="whose job it is (the tenant of the key that created it)")
    parent_job_id: str | None = Field(None, description="a retry: the job whose failed rows this one "
                                                        "runs again")
    expires_at: datetime | None = Field(None, description="when its completion_window passes (None: never)")

    def transition(self, target: JobState, *, at: datetime | None = None,
                   error: str | None = None) -> JobStatus:
        """A copy in `target`, with the timestamps that state implies; a failure must say why."""
        check_transition(self.state, target)
        if target == JobState.FAILED and not error:
            raise ValueError("a failed job needs an error message saying why")
        at = at or datetime.now(UTC)
        changes: dict[str, object] = {"state": target}
        if target == JobState.RUNNING:
            changes["started_at"] = at
        if target == JobState.FINALIZING:
            changes["finalizing_at"] = at
        if target.is_terminal:
            changes["finished_at"] = at
        if error:
            changes["error"] = error
        return self.model_copy(update=changes)

    def with_counts(self, rows: RowCounts, shards: ShardCounts, usage: TokenUsage) -> JobStatus:
        return self.model_copy(update={"rows": rows, "shards": shards, "usage": usage})
