"""Fair share against a live deployment with one worker: a small job submitted behind a large one
finishes first, since each free worker slot takes the fairest waiting shard (jobs/fair_queue.py),
not the oldest message; and a higher priority's shards go before a lower one's."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bulkinfer.jobs.state.status import JobState
from tests.api.live_stack import LiveStack, live_stack
from tests.fixtures.services import RedisServer, S3Server

pytestmark = pytest.mark.timeout(300)

BIG_SHARDS = 12
SHARD_ROWS = 8
SAMPLING = {"max_tokens": 48, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def stack(redis_server: RedisServer, s3_server: S3Server, tiny_checkpoint: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveStack]:
    with live_stack(redis_server, s3_server, tiny_checkpoint, tmp_path_factory.mktemp("model-cache")) as live:
        yield live


def _submit(stack: LiveStack, name: str, rows: int, **fields: object) -> str:
    lines = b"".join(json.dumps({"q": f"{name} {n}"}).encode() + b"\n" for n in range(rows))
    job = stack.client.jobs.create({"input_uri": stack.put_input(f"{name}.jsonl", lines), "model": "tiny",
                                    "prompt_column": "q", "shard_size": SHARD_ROWS, "sampling": SAMPLING,
                                    **fields})
    return job.job_id


def _finished_at(stack: LiveStack, job_id: str) -> float:
    final = stack.client.jobs.wait(job_id, timeout=240, progress=False, poll_interval=0.1)
    assert final.state == JobState.SUCCEEDED
    assert final.finished_at is not None
    return final.finished_at.timestamp()


def _until_planned(stack: LiveStack, job_id: str) -> None:
    deadline = time.monotonic() + 30
    while stack.client.jobs.get(job_id).shards.total == 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_small_job_behind_a_large_one_finishes_first(stack: LiveStack) -> None:
    big = _submit(stack, "big", BIG_SHARDS * SHARD_ROWS)
    _until_planned(stack, big)  # every big shard is queued before the small job exists
    small = _submit(stack, "small", 2)
    assert _finished_at(stack, small) < _finished_at(stack, big)
    status = stack.client.jobs.get(big)
    assert (status.rows.succeeded, status.shards.done) == (BIG_SHARDS * SHARD_ROWS, BIG_SHARDS)


def test_a_higher_priority_goes_first(stack: LiveStack) -> None:
    low = _submit(stack, "low", BIG_SHARDS * SHARD_ROWS, priority="low")
    _until_planned(stack, low)
    normal = _submit(stack, "normal", 4 * SHARD_ROWS)  # would share fairly with `low` were they equal
    _until_planned(stack, normal)
    high = _submit(stack, "high", 4 * SHARD_ROWS, priority="high")
    high_done, normal_done, low_done = (_finished_at(stack, job) for job in (high, normal, low))
    assert high_done <= normal_done < low_done
