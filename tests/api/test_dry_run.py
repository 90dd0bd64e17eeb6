"""Dry runs: `POST /jobs` with `"dry_run": true` (SDK `jobs.estimate`, CLI `submit --dry-run`) checks
what a submit checks and answers an estimate without creating anything; its token counts are the ones
the job then computes. Against a live deployment (the worker publishes its tokenizer when it loads)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bulkinfer.api.client import ApiError
from bulkinfer.jobs.state.status import JobState
from tests.api.live_stack import LiveStack, live_stack
from tests.fixtures.services import REPO_ROOT, RedisServer, S3Server

pytestmark = pytest.mark.timeout(300)

INSTRUCTIONS = "Answer the question in the style of a patient teacher, briefly and kindly. " * 3
SPEC = {"model": "tiny", "template": "Q: {q}", "instructions": INSTRUCTIONS, "shard_size": 4,
        "sampling": {"max_tokens": 5, "temperature": 0, "ignore_eos": True}}


@pytest.fixture(scope="module")
def stack(redis_server: RedisServer, s3_server: S3Server, tiny_checkpoint: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveStack]:
    with live_stack(redis_server, s3_server, tiny_checkpoint, tmp_path_factory.mktemp("model-cache")) as live:
        yield live


def _rows(stack: LiveStack, name: str) -> str:
    questions = ["why is the sky blue", "what is rain", "why is the sky blue", "how do birds fly", "hmm",
                 "what is snow"]
    lines = [json.dumps({"q": q}) for q in questions] + ['{"not a row"', json.dumps({"other": 1})]
    return stack.put_input(name, ("\n".join(lines) + "\n").encode())


def _estimate_when_published(stack: LiveStack, uri: str) -> dict:
    deadline = time.monotonic() + 60  # the worker publishes the tokenizer once it has loaded the model
    while True:
        estimate = stack.client.jobs.estimate({**SPEC, "input_uri": uri}).model_dump()
        if estimate["prompt_tokens"] is not None or time.monotonic() > deadline:
            return estimate
        time.sleep(0.2)


def test_a_dry_run_counts_what_the_job_then_computes_and_creates_nothing(stack: LiveStack) -> None:
    uri = _rows(stack, "rows.jsonl")
    before = list(stack.client.jobs.list())
    estimate = _estimate_when_published(stack, uri)
    assert list(stack.client.jobs.list()) == before  # nothing created
    assert (estimate["rows"], estimate["rows_read"], estimate["shards"]) == (8, 8, 2)
    assert (estimate["rows_failing"], estimate["rows_deduplicated"]) == (2, 1)  # bad JSON, no `q`; a repeat
    assert estimate["max_output_tokens"] == 5 * 5  # the five rows that run
    assert 0 < estimate["shared_prefix_tokens"] < estimate["prompt_tokens"]
    assert "tiny's own, published by worker" in estimate["tokenizer"]

    job = stack.client.jobs.create({**SPEC, "input_uri": uri})
    final = stack.client.jobs.wait(job, timeout=120, progress=False, poll_interval=0.1)
    assert final.state == JobState.SUCCEEDED
    status = stack.client.jobs.get(job)
    assert status.usage.prompt == estimate["prompt_tokens"]  # the same count as the worker's
    assert status.rows.deduplicated == estimate["rows_deduplicated"]
    assert status.rows.failed == estimate["rows_failing"]
    assert status.usage.completion == estimate["max_output_tokens"]


def test_the_run_time_is_estimated_from_measured_throughput_once_there_is_one(stack: LiveStack) -> None:
    lines = b"".join(json.dumps({"q": f"question {n}"}).encode() + b"\n" for n in range(64))
    uri = stack.put_input("long.jsonl", lines)
    spec = {**SPEC, "input_uri": uri, "sampling": {"max_tokens": 200, "ignore_eos": True, "temperature": 0}}
    job = stack.client.jobs.create(spec)  # keeps the engine busy well over a second: a measurement
    stack.client.jobs.wait(job, timeout=120, progress=False, poll_interval=0.2)
    deadline = time.monotonic() + 30
    while (estimate := stack.client.jobs.estimate(spec)).estimated_seconds is None:
        assert time.monotonic() < deadline, estimate.estimate_basis  # the next heartbeat carries it
        time.sleep(0.5)
    assert estimate.estimated_seconds > 0
    basis = estimate.estimate_basis
    assert "tokens per engine-busy second" in basis and "1 live worker" in basis


def test_a_dry_run_refuses_what_a_submit_refuses(stack: LiveStack) -> None:
    uri = _rows(stack, "refused.jsonl")
    for body, code in [({**SPEC, "input_uri": uri, "model": "nope"}, 400),
                       ({**SPEC, "input_uri": uri, "template": "Q: {missing}"}, 400),
                       ({**SPEC, "input_uri": uri, "shard_size": 0}, 422),
                       ({**SPEC, "input_uri": "s3://sdk-inputs/absent.jsonl"}, 400)]:
        answer = httpx.post(f"{stack.url}/jobs", json={**body, "dry_run": True})
        assert answer.status_code == code, answer.text
    with pytest.raises(ApiError):
        stack.client.jobs.estimate({**SPEC, "input_uri": uri, "completion_window": "99d"})


def test_the_cli_estimates_an_uploaded_file_and_keeps_nothing(stack: LiveStack, tmp_path: Path) -> None:
    path = tmp_path / "local.jsonl"
    path.write_text("".join(json.dumps({"q": f"q{n}"}) + "\n" for n in range(3)))
    objects_before = _job_store_objects(stack)
    done = subprocess.run([sys.executable, "-m", "bulkinfer.api.cli", "submit", str(path), "--model", "tiny",
                           "--template", "Q: {q}", "--max-tokens", "7", "--dry-run", "--json",
                           "--api-url", stack.url], capture_output=True, text=True, cwd=REPO_ROOT,
                          env=stack.cli_env(), timeout=60)
    assert done.returncode == 0, done.stderr
    estimate = json.loads(done.stdout)
    assert (estimate["dry_run"], estimate["rows"], estimate["max_output_tokens"]) == (True, 3, 21)
    assert _job_store_objects(stack) == objects_before  # the upload was removed


def _job_store_objects(stack: LiveStack) -> list[str]:
    listing = stack.s3.client().list_objects_v2(Bucket="sdk-jobs", Prefix="bulkinfer/jobs/")
    return sorted(item["Key"] for item in listing.get("Contents", []))
