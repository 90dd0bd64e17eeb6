"""Usage: each job's tokens, deduplicated rows and attributed engine seconds, and `GET /usage` (SDK
`client.usage`, CLI `bulkinfer usage`) summing them per tenant and model, against a live deployment
with two tenants and an admin key."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from bulkinfer.api.client import ApiError, Client
from bulkinfer.jobs.state.status import JobState
from tests.api.live_stack import INPUTS_BUCKET, LiveStack, live_stack
from tests.fixtures.services import REPO_ROOT, RedisServer, S3Server

pytestmark = pytest.mark.timeout(300)

KEYS = {"acme": "acme-key", "globex": "globex-key"}
ADMIN_KEY = "admin-key"


@pytest.fixture(scope="module")
def stack(redis_server: RedisServer, s3_server: S3Server, tiny_checkpoint: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveStack]:
    keys = ",".join(f"{tenant}={key}" for tenant, key in KEYS.items())
    fields = {"api_keys": keys, "admin_api_keys": ADMIN_KEY,  # the inputs bucket is theirs to read
              "tenant_prefixes": {tenant: [f"s3://{INPUTS_BUCKET}/"] for tenant in KEYS}}
    with live_stack(redis_server, s3_server, tiny_checkpoint, tmp_path_factory.mktemp("model-cache"),
                    settings_fields=fields,
                    client_options={"timeout": 30, "backoff": 0.05, "api_key": ADMIN_KEY}) as live:
        yield live


def _client(stack: LiveStack, key: str) -> Client:
    return Client(stack.url, api_key=key, timeout=30, backoff=0.05)


def _run(stack: LiveStack, client: Client, name: str, prompts: list[str]) -> str:
    lines = b"".join(json.dumps({"q": prompt}).encode() + b"\n" for prompt in prompts)
    job = client.jobs.create({"input_uri": stack.put_input(f"{name}.jsonl", lines), "model": "tiny",
                              "prompt_column": "q", "shard_size": 4,
                              "sampling": {"max_tokens": 8, "temperature": 0, "ignore_eos": True}})
    assert client.jobs.wait(job, timeout=120, progress=False, poll_interval=0.1).state == JobState.SUCCEEDED
    return job.job_id


def test_jobs_report_their_engine_seconds_and_usage_sums_them_per_tenant(stack: LiveStack) -> None:
    since = datetime.now(UTC) - timedelta(hours=1)
    with _client(stack, KEYS["acme"]) as acme, _client(stack, KEYS["globex"]) as globex:
        acme_job = _run(stack, acme, "acme", [f"question {n}" for n in range(6)])
        # Two identical greedy rows run once: the copy costs no tokens and no engine time.
        globex_job = _run(stack, globex, "globex", ["same question", "same question", "other"])
        acme_status, globex_status = acme.jobs.get(acme_job), globex.jobs.get(globex_job)
        assert acme_status.usage.engine_seconds > 0 and globex_status.usage.engine_seconds > 0
        assert globex_status.rows.deduplicated == 1
        rows = list(globex.jobs.results(globex_job))
        assert rows[0]["usage"] == rows[1]["usage"]  # the copy shows the tokens its output took…
        assert globex_status.usage.completion == 2 * 8  # …but the job counts the two rows that ran

        report = stack.client.usage(since=since)  # the admin key: every tenant
        by_tenant = {line.tenant: line for line in report.lines}
        assert set(by_tenant) == {"acme", "globex"}
        assert by_tenant["acme"].usage.completion == acme_status.usage.completion
        assert by_tenant["acme"].usage.prompt == acme_status.usage.prompt
        assert (by_tenant["globex"].rows, by_tenant["globex"].rows_deduplicated) == (3, 1)
        assert abs(by_tenant["acme"].usage.engine_seconds - acme_status.usage.engine_seconds) < 0.01
        assert report.total.rows == 9 and report.total.shards == 3

        own = acme.usage(since=since)  # a tenant's key: its own usage only
        assert [line.tenant for line in own.lines] == ["acme"]
        with pytest.raises(ApiError) as refused:
            acme.usage(tenant="globex")
        assert refused.value.status_code == 403
        assert stack.client.usage(since=since, model="other-model").lines == []
        with pytest.raises(ApiError) as backwards:
            stack.client.usage(since=since, until=since - timedelta(hours=1))
        assert backwards.value.status_code == 422

    done = subprocess.run([sys.executable, "-m", "bulkinfer.api.cli", "usage", "--since", since.isoformat(),
                           "--api-url", stack.url, "--api-key", ADMIN_KEY], capture_output=True, text=True,
                          cwd=REPO_ROOT, env=stack.cli_env(), timeout=60)
    assert done.returncode == 0, done.stderr
    table = done.stdout.splitlines()
    assert any(line.startswith("acme ") and " tiny " in line for line in table)
    assert table[-1].split()[3] == "9"  # the total's rows
