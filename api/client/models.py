"""The typed bodies the API returns. A job's status is the server's own `JobStatus` model (torch-free)."""

from __future__ import annotations

from pydantic import BaseModel

from jobs.results import TokenUsage
from jobs.spec import InputFormat, JobSpec
from jobs.status import JobState, JobStatus, RowCounts, ShardCounts

Job = JobStatus  # what `client.jobs.get` returns, under a shorter name

__all__ = ["InputFormat", "Job", "JobPage", "JobResults", "JobSpec", "JobState", "JobStatus", "ResultPart",
           "RowCounts", "ShardCounts", "TokenUsage"]


class JobPage(BaseModel):
    """One page of `GET /jobs`: pass `next_cursor` back for the next one (None on the last)."""

    jobs: list[JobStatus]
    next_cursor: str | None = None


class ResultPart(BaseModel):
    shard_index: int
    first_row: int | None = None
    rows: int
    bytes: int
    sha256: str
    uri: str
    url: str  # presigned http(s) URL, or file:// for a local store


class JobResults(BaseModel):
    """A succeeded job's output parts (`GET /jobs/{id}/results`)."""

    job_id: str
    output_format: str
    rows: RowCounts
    usage: TokenUsage
    parts: list[ResultPart]
    error_parts: list[ResultPart]
