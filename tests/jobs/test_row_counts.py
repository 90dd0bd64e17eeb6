"""JSONL row counts are exact, whatever the line lengths: the shard plan's cuts and every limit that
counts rows come from one streaming pass (jobs/formats/row_starts.py), not from the file's head."""

from __future__ import annotations

import random

from bulkinfer.jobs.formats.readers import read_shard_rows
from bulkinfer.jobs.formats.row_starts import count_row_starts
from bulkinfer.jobs.limits import plan_limit_problems
from bulkinfer.jobs.planning.sharding import plan_shards
from bulkinfer.jobs.settings import Settings
from bulkinfer.jobs.spec import JobSpec

SPEC = JobSpec(input_uri="s3://b/rows.jsonl", input_format="jsonl", model="m", prompt_column="q")


def test_a_1_mib_first_line_then_many_small_lines_counts_exactly_for_max_rows_per_job(local_store) -> None:
    small_lines = 150_000
    data = b'{"q": "' + b"x" * (1 << 20) + b'"}\n' + b'{"q": "y"}\n' * small_lines
    local_store.put_bytes("rows.jsonl", data)
    spec = SPEC.model_copy(update={"shard_size": 20_000})

    plan = plan_shards(local_store, "rows.jsonl", spec)

    rows = small_lines + 1
    assert sum(shard.estimated_rows for shard in plan) == rows and all(shard.rows_exact for shard in plan)
    assert max(shard.estimated_rows for shard in plan) == 20_000  # no shard holds more than asked
    assert plan_limit_problems(Settings(max_rows_per_job=rows), plan, spec.shard_size) == []
    [problem] = plan_limit_problems(Settings(max_rows_per_job=rows - 1), plan, spec.shard_size)
    assert f"the input has {rows:,} rows" in problem
    assert [sum(1 for _ in read_shard_rows(local_store, "rows.jsonl", spec, shard)) for shard in plan[-2:]] \
        == [shard.estimated_rows for shard in plan[-2:]]


def random_jsonl(rng: random.Random) -> bytes:
    kinds = [b"", b" ", b"\r", b" \t\x0b\x0c", b'{"q": "a"}', b'{"q": "' + b"b" * 70 + b'"}', b"not json",
             b" x "]
    lines = [rng.choice(kinds) for _ in range(rng.randint(0, 40))]
    data = b"\n".join(lines) + (b"\n" if rng.random() < 0.5 else b"")
    return (b"\xef\xbb\xbf" if rng.random() < 0.2 else b"") + data


def test_the_streaming_count_matches_what_the_readers_read_for_any_chunking(local_store) -> None:
    rng = random.Random(7)
    for _ in range(300):
        data = random_jsonl(rng)
        local_store.put_bytes("rows.jsonl", data)
        shard_size = rng.choice([1, 2, 3, 5, 100])
        chunk = rng.choice([1, 2, 3, 4, 7, 16, 1 << 20])
        starts = count_row_starts(local_store, "rows.jsonl", shard_size, chunk_size=chunk)
        plan = plan_shards(local_store, "rows.jsonl", SPEC.model_copy(update={"shard_size": shard_size}))
        assert [shard.byte_start for shard in plan] == starts.cuts, (data, shard_size, chunk)
        read = [sum(1 for _ in read_shard_rows(local_store, "rows.jsonl", SPEC, shard)) for shard in plan]
        planned = [shard.estimated_rows for shard in plan]
        assert read == starts.shard_rows() == planned, (data, shard_size, chunk)
        assert all(count <= shard_size for count in read) and sum(read) == starts.rows
