"""Partial results: `GET /jobs/{id}/results?partial=true` (SDK `results(job, partial=True)`, CLI
`results --partial`) answers for a job that has not succeeded with the shards finished so far, in
shard order, marked partial; without asking, an unfinished job is still a 409 that says how to ask.
The shards are written by the worker's own code (staged, committed, published), one left unpublished."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime

import httpx
import pytest

from bulkinfer.api.client import ApiError
from bulkinfer.jobs.formats.output import OutputRow
from bulkinfer.jobs.planning.sharding import ShardPlan
from bulkinfer.jobs.state.part_publication import publish_parts, write_fenced
from tests.fixtures.services import REPO_ROOT

SHARD_ROWS = 3


@pytest.fixture
def running_job(local_api) -> str:  # noqa: ANN001
    """A job whose shards 0 and 2 finished and whose shard 1 committed but is not published yet;
    shard 3 has not run."""
    lines = b"".join(json.dumps({"q": f"question {n}"}).encode() + b"\n" for n in range(4 * SHARD_ROWS))
    uri = local_api.put_input("rows.jsonl", lines)
    job = local_api.client.jobs.create({"input_uri": uri, "model": "tiny", "prompt_column": "q",
                                        "shard_size": SHARD_ROWS})
    repository, store = local_api.repository, local_api.store
    spec = repository.get_spec(job.job_id)  # the API stored it resolved (input format detected)
    layout = repository.layout(job.job_id)
    for shard in (0, 1, 2):
        rows = range(shard * SHARD_ROWS, (shard + 1) * SHARD_ROWS)
        outputs = [OutputRow(index=n, row_id=str(n), text=f"answer {n}", finish_reason="stop",
                             prompt_tokens=4, completion_tokens=2) for n in rows]
        plan = ShardPlan(index=shard, estimated_rows=SHARD_ROWS, rows_exact=True)
        result = write_fenced(store, layout, spec, plan, outputs, fence=f"g1-test{shard}", created=0,
                              started_at=datetime.now(UTC))
        if shard != 1:
            publish_parts(store, result)
    return job.job_id


def test_an_unfinished_job_answers_409_saying_how_to_ask_for_partial_results(local_api,  # noqa: ANN001
                                                                             running_job: str) -> None:
    with pytest.raises(ApiError) as refused:
        local_api.client.jobs.results(running_job).info  # noqa: B018 - the request is the test
    assert refused.value.status_code == 409 and "partial=true" in refused.value.message


def test_partial_results_hold_the_published_shards_in_order(local_api, running_job) -> None:
    info = httpx.get(f"{local_api.url}/jobs/{running_job}/results", params={"partial": "true"}).json()
    assert (info["partial"], info["state"], info["shards_done"]) == (True, "queued", 2)
    assert [part["shard_index"] for part in info["parts"]] == [0, 2]
    assert (info["rows"]["total"], info["usage"]["completion"]) == (2 * SHARD_ROWS, 4 * SHARD_ROWS)
    download = httpx.get(f"{local_api.url}/jobs/{running_job}/results",
                         params={"partial": "true", "download": "true"})
    assert download.headers["x-bulkinfer-partial"] == "true"
    streamed = [json.loads(line)["id"] for line in download.text.splitlines()]
    expected = [str(n) for n in [*range(SHARD_ROWS), *range(2 * SHARD_ROWS, 3 * SHARD_ROWS)]]
    assert streamed == expected
    results = local_api.client.jobs.results(running_job, partial=True)
    assert results.partial and [row["id"] for row in results] == expected


def test_the_cli_prints_partial_rows_and_says_so_on_stderr(local_api, running_job) -> None:
    done = subprocess.run([sys.executable, "-m", "bulkinfer.api.cli", "results", running_job, "--partial",
                           "--api-url", local_api.url], capture_output=True, text=True, cwd=REPO_ROOT,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.splitlines()) == 2 * SHARD_ROWS
    assert f"partial: job {running_job} is queued; 2 of" in done.stderr
