"""One tenant cannot starve another, against a live deployment with keys and one worker: tenant A
submits the most it may (the highest priority the deployment lets it use, 16 samples a row, a huge
`shard_size`); tenant B's small normal job, submitted behind it, waits for at most about one of A's
shards. Three rules hold it: A may not ask for more than `normal` (jobs/priority_caps.py), the fair
queue charges A the tokens its 16 samples cost rather than its rows, and the planner cuts A's job
into shards within `max_shard_tokens` (jobs/planning/shard_cost.py)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bulkinfer.api.client import ApiError, Client
from bulkinfer.jobs.state.results import load_shard_results
from bulkinfer.jobs.state.status import JobState
from tests.api.live_stack import INPUTS_BUCKET, LiveStack, live_stack
from tests.fixtures.services import RedisServer, S3Server

pytestmark = pytest.mark.timeout(300)

KEYS = {"acme": "acme-key", "globex": "globex-key"}
A_ROWS = 48
SHARD_TOKENS = 600  # about 4 of A's rows (8 tokens x 16 samples each, plus the prompt)
SAMPLING = {"max_tokens": 8, "ignore_eos": True, "temperature": 0.8, "seed": 1}
SLACK_S = 3.0  # planning B's job and the API's polling, on a loaded 2-core machine


@pytest.fixture(scope="module")
def stack(redis_server: RedisServer, s3_server: S3Server, tiny_checkpoint: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveStack]:
    fields = {"api_keys": ",".join(f"{tenant}={key}" for tenant, key in KEYS.items()),
              "max_shard_tokens": SHARD_TOKENS,
              "tenant_prefixes": json.dumps({tenant: [f"s3://{INPUTS_BUCKET}/"] for tenant in KEYS})}
    with live_stack(redis_server, s3_server, tiny_checkpoint, tmp_path_factory.mktemp("model-cache"),
                    settings_fields=fields) as live:
        yield live


def _client(stack: LiveStack, tenant: str) -> Client:
    return Client(stack.url, api_key=KEYS[tenant], timeout=30, backoff=0.05)


def _spec(stack: LiveStack, name: str, rows: int, **fields: object) -> dict:
    lines = b"".join(json.dumps({"q": f"{name} {n}"}).encode() + b"\n" for n in range(rows))
    return {"input_uri": stack.put_input(f"{name}.jsonl", lines), "model": "tiny", "prompt_column": "q",
            "sampling": SAMPLING, **fields}


def _shards_running(client: Client, job_id: str) -> None:
    deadline = time.monotonic() + 60
    while not (status := client.jobs.get(job_id)).shards.total or status.state != JobState.RUNNING:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_tenant_at_its_highest_priority_with_16_samples_and_huge_shards_does_not_starve_another(
        stack: LiveStack) -> None:
    with _client(stack, "acme") as acme, _client(stack, "globex") as globex:
        with pytest.raises(ApiError) as refused:  # above the default cap: not silently lowered
            acme.jobs.create(_spec(stack, "a-high", A_ROWS, priority="high"))
        assert refused.value.status_code == 403
        greedy = acme.jobs.create(_spec(stack, "a", A_ROWS, priority="normal", shard_size=1_000_000,
                                        sampling={**SAMPLING, "n": 16})).job_id
        _shards_running(acme, greedy)
        submitted = time.time()
        small = globex.jobs.create(_spec(stack, "b", 2)).job_id
        small_status = globex.jobs.wait(small, timeout=240, progress=False, poll_interval=0.1)
        big_status = acme.jobs.wait(greedy, timeout=240, progress=False, poll_interval=0.1)

    assert small_status.state == big_status.state == JobState.SUCCEEDED
    assert big_status.rows.succeeded == A_ROWS and big_status.shards.total >= A_ROWS // 8  # cut up
    repository = stack.repository
    big_shards = load_shard_results(repository.store, repository.layout(greedy))
    [small_shard] = load_shard_results(repository.store, repository.layout(small))
    longest = max((shard.finished_at - shard.started_at).total_seconds() for shard in big_shards)
    # B's rows were done within one of A's shards (and a little for planning B): neither A's
    # priority, nor its samples, nor its shard size put B behind the rest of A's job.
    turnaround = small_shard.finished_at.timestamp() - submitted
    assert turnaround <= longest + SLACK_S, (turnaround, longest)
    # B ran while A still had most of its shards to go, not after them.
    assert sum(shard.started_at > small_shard.finished_at for shard in big_shards) >= len(big_shards) // 2
