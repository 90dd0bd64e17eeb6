"""The typed bodies the API returns: the server's own models (pydantic only, torch-free), so the two
cannot drift apart."""

from __future__ import annotations

from bulkinfer.api.schemas import JobPage, JobResults, ResultPart
from bulkinfer.jobs.spec import InputFormat, JobSpec
from bulkinfer.jobs.state.results import TokenUsage
from bulkinfer.jobs.state.status import JobState, JobStatus, RowCounts, ShardCounts

Job = JobStatus  # what `client.jobs.get` returns, under a shorter name

__all__ = ["InputFormat", "Job", "JobPage", "JobResults", "JobSpec", "JobState", "JobStatus", "ResultPart",
           "RowCounts", "ShardCounts", "TokenUsage"]
