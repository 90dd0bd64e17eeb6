"""The bulkinfer Python SDK: `Client` (sync) and `AsyncClient` over httpx. Needs no torch and no server
pieces: pydantic, httpx and rich, plus pyarrow (the `client` extra) for tables and Parquet.

    from bulkinfer.api.client import Client

    with Client("http://127.0.0.1:8000", api_key="...") as client:
        job = client.jobs.create(input="s3://bucket/rows.parquet", model="small", prompt_column="q")
        job = client.jobs.wait(job, timeout=3600)
        for row in client.jobs.results(job):
            print(row["id"], row["text"])

Failures: `ApiError` (status code, the server's message, one line per problem); `WaitTimeout` from
`jobs.wait`; an `httpx.TransportError` when the server cannot be reached after the retries.
"""

from bulkinfer.api.client.client import DEFAULT_BASE_URL, AsyncClient, Client
from bulkinfer.api.client.errors import ApiError, WaitTimeout
from bulkinfer.api.client.jobs import AsyncJobs, Jobs
from bulkinfer.api.client.models import (
    InputFormat,
    Job,
    JobPage,
    JobResults,
    JobSpec,
    JobState,
    JobStatus,
    ResultPart,
    RowCounts,
    ShardCounts,
    TokenUsage,
)
from bulkinfer.api.client.results import AsyncResults, Results
from bulkinfer.api.client.transport import AsyncTransport, RetryPolicy, Transport

__all__ = ["DEFAULT_BASE_URL", "ApiError", "AsyncClient", "AsyncJobs", "AsyncResults", "AsyncTransport",
           "Client", "InputFormat", "Job", "JobPage", "JobResults", "JobSpec", "JobState", "JobStatus",
           "Jobs", "ResultPart", "Results", "RetryPolicy", "RowCounts", "ShardCounts", "TokenUsage",
           "Transport", "WaitTimeout"]
