"""The prefix KV tier across worker processes (issue 47): one worker computes a shared instruction
and saves its blocks to the S3 store; a fresh worker process loads them instead of computing, with
the same greedy outputs; another tenant with the same prefix loads nothing; a store that goes down
mid-load costs only the load (computed instead), never the job."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from bulkinfer.jobs.spec import JobSpec
from bulkinfer.jobs.state.status import JobState
from tests.fixtures.services import RedisServer, S3Server, celery_worker, free_port, wait_until
from tests.support.s3_fault_proxy import FaultPlan, s3_fault_proxy
from tests.worker.conftest import ENGINE_OPTIONS, JOBS_BUCKET, STORE_PREFIX, Pipeline, bare_pipeline

pytestmark = pytest.mark.timeout(600)

QUEUES = "bulkinfer.control,bulkinfer.model.tiny"
# Two instructions of several full 16-token blocks each, each shared by a job's rows.
SUMMARY = "You are a careful analyst. Summarise the quarterly revenue report for the board, region by: " * 2
TRIAGE = "Classify each support ticket by urgency and product area, then name the team that owns it: " * 2
AUDIT = "List every invoice paid twice last month, with the vendor, both dates and the amount due: " * 2
QUESTIONS = ["north", "south", "east"]
# The tiny model's prefixes are short: load any matched prefix (the engine's break-even is for real ones).
KV_ENGINE_OPTIONS = {**ENGINE_OPTIONS, "kv_store_min_tokens": 16}


def metric(port: int, name: str) -> float:
    """The sum of one metric's samples on a worker's /metrics (0 when absent)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and line[len(name)] in "{ ")


def run_job(pipeline: Pipeline, name: str, instruction: str, tenant: str) -> dict[str, str]:
    """Run one job of the instruction's rows for `tenant`; its outputs by row id."""
    lines = [json.dumps({"id": question, "q": f"{instruction}{question}"}) for question in QUESTIONS]
    spec = JobSpec(input_uri=pipeline.put_input(f"{name}.jsonl", lines), model="tiny", id_column="id",
                   prompt_column="q", sampling={"temperature": 0.0, "max_tokens": 8}, tenant=tenant)
    job_id = pipeline.submit(spec)
    status = pipeline.wait_for_end(job_id, timeout=180)
    assert status.state == JobState.SUCCEEDED, status.error
    return {record["id"]: record["text"] for record in pipeline.output_records(job_id)}


def stored_blocks(pipeline: Pipeline) -> dict[str, int]:
    """The KV blocks in the store's kv/ folder: key -> size."""
    pages = pipeline.s3.client().get_paginator("list_objects_v2").paginate(
        Bucket=JOBS_BUCKET, Prefix=f"{STORE_PREFIX}/kv/")
    return {item["Key"]: item["Size"] for page in pages for item in page.get("Contents", [])}


@dataclass
class Cluster:
    pipeline: Pipeline
    computed: dict[str, dict[str, str]]  # instruction -> outputs, as the first worker computed them
    saved_blocks: float  # what the first worker saved
    audit_blocks: list[str]  # the keys of the blocks it saved for AUDIT
    loader_port: int  # the second worker's /metrics
    faults: FaultPlan  # between the second worker and S3 (off until a test turns it on)


def worker_env(env: dict[str, str], port: int, cache: Path, endpoint: str) -> dict[str, str]:
    # kv_store is left "auto": on, because the store is a bucket.
    return {**env, "BULKINFER_WORKER_METRICS_PORT": str(port), "BULKINFER_KV_STORE_CACHE_DIR": str(cache),
            "BULKINFER_ENGINE_OPTIONS": json.dumps(KV_ENGINE_OPTIONS), "BULKINFER_S3_ENDPOINT_URL": endpoint}


def wait_ready(port: int) -> None:
    wait_until(lambda: httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5).status_code == 200, 180,
               f"the worker on {port} to load its model")


@pytest.fixture(scope="module")
def cluster(redis_server: RedisServer, s3_server: S3Server, tiny_checkpoint: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    s3_server.reset()
    redis_server.client().flushall()
    model_cache = tmp_path_factory.mktemp("models")
    with pytest.MonkeyPatch.context() as patch:
        for name, value in s3_server.env().items():  # this process's S3 clients (the test's pipeline)
            patch.setenv(name, value)
        yield from _cluster(redis_server, s3_server, tiny_checkpoint, model_cache, tmp_path_factory)


def _cluster(redis_server: RedisServer, s3_server: S3Server, tiny_checkpoint: Path, model_cache: Path,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with bare_pipeline(redis_server.url, s3_server, tiny_checkpoint, model_cache) as (pipeline, env):
        first_port = free_port()
        first = worker_env(env, first_port, tmp_path_factory.mktemp("kv-cache-a"), s3_server.endpoint_url)
        with celery_worker("bulkinfer.worker.process.celery_app", redis_server.url, env=first, queues=QUEUES,
                           pool="threads",
                           concurrency=2, ready_timeout=120):
            wait_ready(first_port)
            computed = {instruction: run_job(pipeline, f"computed-{n}", instruction, "acme")
                        for n, instruction in enumerate((SUMMARY, TRIAGE))}
            earlier = set(stored_blocks(pipeline))
            computed[AUDIT] = run_job(pipeline, "computed-audit", AUDIT, "acme")
            audit_blocks = sorted(set(stored_blocks(pipeline)) - earlier)
            saved_blocks = metric(first_port, "bulkinfer_kv_store_saved_blocks_total")
            assert metric(first_port, "bulkinfer_kv_store_hit_blocks_total") == 0  # nothing to load yet
        faults = FaultPlan(["internal"], every=1)
        faults.enabled = False
        with s3_fault_proxy(s3_server.endpoint_url, faults) as proxy:
            loader_port = free_port()
            second = worker_env(env, loader_port, tmp_path_factory.mktemp("kv-cache-b"), proxy.endpoint_url)
            with celery_worker("bulkinfer.worker.process.celery_app", redis_server.url, env=second,
                               queues=QUEUES,
                               pool="threads", concurrency=2, ready_timeout=120):
                wait_ready(loader_port)
                yield Cluster(pipeline, computed, saved_blocks, audit_blocks, loader_port, faults)


def test_the_first_worker_saves_the_shared_instruction_to_the_stores_kv_folder(cluster: Cluster) -> None:
    assert cluster.saved_blocks >= 3 * 3  # each instruction, several full blocks each
    assert len(stored_blocks(cluster.pipeline)) >= cluster.saved_blocks


def test_a_fresh_worker_process_loads_the_blocks_instead_of_computing_with_identical_greedy_outputs(
        cluster: Cluster) -> None:
    hits = metric(cluster.loader_port, "bulkinfer_kv_store_hit_blocks_total")
    loaded = run_job(cluster.pipeline, "loaded", SUMMARY, "acme")
    assert loaded == cluster.computed[SUMMARY]
    assert metric(cluster.loader_port, "bulkinfer_kv_store_hit_blocks_total") - hits >= 3
    assert metric(cluster.loader_port, "bulkinfer_kv_store_loaded_bytes_total") > 0


def test_another_tenant_with_the_same_prefix_loads_none_of_the_first_tenants_blocks(cluster: Cluster) -> None:
    hits = metric(cluster.loader_port, "bulkinfer_kv_store_hit_blocks_total")
    theirs = run_job(cluster.pipeline, "other-tenant", SUMMARY, "globex")
    assert theirs == cluster.computed[SUMMARY]  # computed: the same answers
    assert metric(cluster.loader_port, "bulkinfer_kv_store_hit_blocks_total") == hits


def test_a_store_outage_mid_load_is_computed_instead_and_the_job_completes(cluster: Cluster) -> None:
    kv_reads = itertools.count()
    # The store answers the first block read of the instruction, then fails every KV read (500).
    cluster.faults.matching = lambda method, path: (method == "GET" and "/kv/" in path
                                                    and next(kv_reads) >= 1)
    failed = metric(cluster.loader_port, "bulkinfer_kv_store_failed_loads_total")
    cluster.faults.enabled = True
    try:
        outputs = run_job(cluster.pipeline, "outage", TRIAGE, "acme")
    finally:
        cluster.faults.enabled = False
    assert outputs == cluster.computed[TRIAGE]
    assert cluster.faults.injected["internal"] > 0
    assert metric(cluster.loader_port, "bulkinfer_kv_store_failed_loads_total") > failed


def test_truncated_stored_blocks_are_detected_deleted_and_computed_with_the_same_outputs(
        cluster: Cluster) -> None:
    client = cluster.pipeline.s3.client()
    assert len(cluster.audit_blocks) >= 3
    truncated = {}
    for key in cluster.audit_blocks:  # the loader has none of them on its disk
        body = client.get_object(Bucket=JOBS_BUCKET, Key=key)["Body"].read()
        truncated[key] = len(body) // 2
        client.put_object(Bucket=JOBS_BUCKET, Key=key, Body=body[: truncated[key]])
    corrupt = metric(cluster.loader_port, "bulkinfer_kv_store_corrupt_blocks_total")
    outputs = run_job(cluster.pipeline, "truncated", AUDIT, "acme")
    assert outputs == cluster.computed[AUDIT]
    found = metric(cluster.loader_port, "bulkinfer_kv_store_corrupt_blocks_total") - corrupt
    assert found >= 1
    after = stored_blocks(cluster.pipeline)
    # Each corrupt block found was deleted (and maybe saved whole again).
    healed = [key for key in cluster.audit_blocks if after.get(key) != truncated[key]]
    assert len(healed) >= found
