"""One tenant's listing reads its own jobs, not every tenant's: a small tenant in a large deployment
(and every submit's in-flight count) used to read the status of every job before answering."""

from __future__ import annotations

import pytest
import redis

from bulkinfer.jobs.spec import JobSpec
from bulkinfer.jobs.state.repository import JobRepository
from bulkinfer.jobs.state.status import JobState


class CountingRepository(JobRepository):
    """Counts the job statuses a listing reads (each one several Redis calls, or store reads)."""

    reads = 0

    def get(self, job_id: str):  # noqa: ANN201
        self.reads += 1
        return super().get(job_id)


@pytest.fixture
def repository(local_store, redis_url) -> CountingRepository:
    return CountingRepository(local_store, redis.Redis.from_url(redis_url))


def spec(tenant: str) -> JobSpec:
    return JobSpec(input_uri="/in/rows.jsonl", input_format="jsonl", model="m", prompt_column="q",
                   tenant=tenant)


def test_a_tenants_listing_reads_its_own_jobs_only(repository) -> None:
    mine = [repository.create(spec("acme")).job_id for _ in range(2)]
    for _ in range(300):
        repository.create(spec("globex"))
    repository.transition(mine[0], JobState.RUNNING)
    repository.reads = 0
    jobs, cursor = repository.list(tenant="acme")
    assert [job.job_id for job in jobs] == mine[::-1] and cursor is None
    assert repository.reads == 2  # it read all 302 before
    repository.reads = 0
    running, _ = repository.list(JobState.RUNNING, tenant="acme")
    queued, _ = repository.list(JobState.QUEUED, tenant="acme")
    assert [job.job_id for job in running] == mine[:1] and [job.job_id for job in queued] == mine[1:]
    assert repository.reads <= 4
    page, cursor = repository.list(tenant="globex", limit=100)
    assert len(page) == 100 and cursor and all(job.tenant == "globex" for job in page)


def test_jobs_recorded_before_tenant_indexes_are_listed_once_the_index_is_built(repository) -> None:
    mine = repository.create(spec("acme")).job_id
    theirs = repository.create(spec("globex")).job_id
    # Redis as an earlier version left it: the shared index only.
    tag = repository._tag
    repository.redis.delete(f"{tag}:tenant:acme", f"{tag}:tenant:globex", f"{tag}:tenant-index-whole")
    assert [job.job_id for job in repository.list(tenant="acme")[0]] == [mine]
    assert [job.job_id for job in repository.list(tenant="globex")[0]] == [theirs]
    assert repository.redis.exists(f"{tag}:tenant-index-whole")
