"""The planner's cross-shard deduplication keeps at most `dedup_max_keys` distinct rows in memory:
within the cap every copy is marked; at the cap the scan stops cleanly for the rest of the job."""

from __future__ import annotations

import json

from jobs.job_dedup import mark_copies
from jobs.sharding import plan_shards
from jobs.spec import JobSpec

SPEC = JobSpec(input_uri="s3://b/rows.jsonl", input_format="jsonl", model="m", prompt_column="q",
               sampling={"temperature": 0.0}, shard_size=2)
# Shards of two rows: [a b] [c a] [d a] [b e]
PROMPTS = ["a", "b", "c", "a", "d", "a", "b", "e"]


def planned(local_store, max_keys: int) -> list[tuple[dict, list]]:
    local_store.put_bytes("rows.jsonl", "".join(json.dumps({"q": q}) + "\n" for q in PROMPTS).encode())
    plan = mark_copies(local_store, "rows.jsonl", SPEC, plan_shards(local_store, "rows.jsonl", SPEC),
                       max_keys=max_keys)
    return [(shard.copies, shard.exports) for shard in plan]


def test_within_the_cap_every_cross_shard_copy_is_marked(local_store) -> None:
    assert planned(local_store, max_keys=5) == [
        ({}, [0, 1]),          # a and b are the sources
        ({1: [0, 0]}, []),     # shard 1's a copies shard 0's
        ({1: [0, 0]}, []),     # so does shard 2's
        ({0: [0, 1]}, []),     # shard 3's b copies shard 0's b
    ]


def test_at_the_cap_the_scan_stops_and_earlier_copies_stay(local_store) -> None:
    # Three distinct rows fit (a, b, c); d would be the fourth: deduplication stops there, so the
    # a and b after it run themselves, and the copy marked before (shard 1's a) stays.
    assert planned(local_store, max_keys=3) == [({}, [0]), ({1: [0, 0]}, []), ({}, []), ({}, [])]
    assert planned(local_store, max_keys=0) == [({}, [])] * 4
