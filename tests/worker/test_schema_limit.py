"""max_schemas_per_job on a real Redis: a job's rows may carry at most N distinct response formats
(counted as the engine compiles them: key order aside, but a `properties` order is a schema of its
own); rows past it are row errors, the same on a rerun."""

from __future__ import annotations

import redis

from bulkinfer.jobs.formats.rows import Row, RowError, RowErrorCode
from bulkinfer.jobs.sampling import JobSampling
from bulkinfer.worker.shards.schema_limit import limit_schemas


def schema(field: str, *, reordered: bool = False, swapped: bool = False) -> dict:
    properties = {field: {"type": "string"}, "n": {"type": "integer"}}
    if swapped:  # the outputs' field order: another grammar
        properties = dict(reversed(list(properties.items())))
    body = {"type": "object", "properties": properties, "required": [field]}
    if reordered:  # the same grammar
        body = dict(reversed(list(body.items())))
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": body}}


def rows(*formats: dict | None) -> list[Row | RowError]:
    return [Row(i, f"r{i}", f"prompt {i}", None, JobSampling(), fmt) for i, fmt in enumerate(formats)]


def codes(items: list[Row | RowError]) -> list[str | None]:
    return [item.code.value if isinstance(item, RowError) else None for item in items]


def test_rows_past_the_jobs_distinct_schema_limit_become_row_errors(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    first = rows(schema("a"), None, schema("a", reordered=True), schema("b"), schema("c"), schema("c"))
    items = limit_schemas(client, "ns-schemas", "job-1", first, limit=2)
    assert codes(items) == [None, None, None, None, "too_many_schemas", "too_many_schemas"]
    assert "more than 2 distinct response formats (max_schemas_per_job)" in items[4].message
    assert items[4].row_id == "r4" and items[4].index == 4
    # A rerun of the shard gets the same answer; another shard may use the admitted schemas only.
    assert codes(limit_schemas(client, "ns-schemas", "job-1", first, limit=2)) == codes(items)
    assert codes(limit_schemas(client, "ns-schemas", "job-1", rows(schema("b"), schema("d")), limit=2)) == [
        None, "too_many_schemas"]
    # Each job has its own count; rows without a schema never touch Redis.
    assert codes(limit_schemas(client, "ns-schemas", "job-2", rows(schema("c"), schema("d")), limit=2)) == [
        None, None]
    assert codes(limit_schemas(client, "ns-schemas", "job-5", rows(schema("a"), schema("a", swapped=True)),
                               limit=1)) == [None, "too_many_schemas"]
    keys_before = set(client.keys("ns-schemas:*"))
    assert codes(limit_schemas(client, "ns-schemas", "job-3", rows(None, None), limit=1)) == [None, None]
    assert set(client.keys("ns-schemas:*")) == keys_before


def test_reader_errors_pass_through_untouched(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    broken = RowError(0, "r0", RowErrorCode.INVALID_JSON, "not JSON")
    items = limit_schemas(client, "ns-schemas", "job-4", [broken, *rows(schema("a"))[0:1]], limit=1)
    assert items[0] is broken and not isinstance(items[1], RowError)
