"""The planner's memory is bounded: cross-shard deduplication keeps at most `dedup_max_keys` distinct
rows (within the cap every copy is marked; at it the scan stops cleanly), and the OpenAI custom_id scan
keeps digests, not the ids."""

from __future__ import annotations

import json

from bulkinfer.jobs.planning.job_dedup import mark_copies
from bulkinfer.jobs.planning.sharding import plan_shards
from bulkinfer.jobs.spec import JobSpec

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


def test_the_custom_id_scan_keeps_digests_not_the_ids(local_store) -> None:
    import tracemalloc

    from bulkinfer.jobs.formats.openai_batch import repeated_custom_id_lines

    def line(custom_id: str) -> str:
        return json.dumps({"custom_id": custom_id, "url": "/v1/completions", "body": {"prompt": "x"}})

    ids = [f"{n:04d}" + "i" * 100_000 for n in range(200)]  # 20 MB of distinct ids
    lines = [line(custom_id) for custom_id in ids] + [line(ids[7])]
    local_store.put_bytes("batch.jsonl", "\n".join(lines).encode())

    tracemalloc.start()
    try:
        repeated = repeated_custom_id_lines(local_store, "batch.jsonl")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert repeated == {sum(len(text) + 1 for text in lines[:-1]): 8}  # the repeat names line 8
    assert peak < 8 << 20  # one line at a time, not every id
