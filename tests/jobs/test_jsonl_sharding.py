"""JSONL byte-range sharding: every line belongs to exactly one shard, whatever the cut points."""

from __future__ import annotations

import json
import random

import pytest

from bulkinfer.jobs.formats.jsonl import iter_jsonl_rows
from bulkinfer.jobs.formats.lines import iter_lines_in_range
from bulkinfer.jobs.formats.readers import read_shard_rows
from bulkinfer.jobs.formats.rows import Row, RowBuilder, RowError, RowErrorCode
from bulkinfer.jobs.planning.sharding import plan_jsonl_shards, plan_shards
from bulkinfer.jobs.spec import JobSpec

SPEC = JobSpec(input_uri="s3://b/rows.jsonl", input_format="jsonl", model="m", prompt_column="q")


def expected_lines(data: bytes) -> list[tuple[int, bytes]]:
    """(offset, line) the slow obvious way, for comparison."""
    lines, offset = [], 0
    for piece in data.split(b"\n"):
        lines.append((offset, piece.removesuffix(b"\r")))
        offset += len(piece) + 1
    if data.endswith(b"\n") or not data:
        lines.pop()
    return lines


def random_file(rng: random.Random) -> bytes:
    lengths = [rng.choice([0, 1, 2, 7, 40, 300]) for _ in range(rng.randint(0, 60))]
    alphabet = b'ab\r{}" '
    lines = [bytes(rng.choice(alphabet) for _ in range(length)) for length in lengths]
    return b"\n".join(lines) + (b"\n" if rng.random() < 0.5 else b"")


def test_any_cut_points_give_every_line_to_exactly_one_range(local_store) -> None:
    rng = random.Random(1234)
    for _ in range(400):
        data = random_file(rng)
        local_store.put_bytes("rows.jsonl", data)
        cuts = sorted({0, len(data), *(rng.randint(0, len(data)) for _ in range(rng.randint(0, 8)))})
        chunk = rng.choice([1, 2, 5, 64, 1 << 20])  # small read chunks exercise lines across reads
        seen = []
        for start, end in zip(cuts, cuts[1:], strict=False):
            seen += [(line.offset, line.data)
                     for line in iter_lines_in_range(local_store, "rows.jsonl", start, end, chunk_size=chunk)]
        assert seen == expected_lines(data), (data, cuts)


def test_planned_shards_cover_every_line_once_for_many_shard_sizes(local_store) -> None:
    rng = random.Random(99)
    for _ in range(60):
        rows = [{"q": "x" * rng.choice([0, 3, 50, 400]), "n": n} for n in range(rng.randint(1, 120))]
        data = b"".join(json.dumps(row).encode() + b"\n" for row in rows)
        if rng.random() < 0.5:
            data = data.rstrip(b"\n")  # no trailing newline
        local_store.put_bytes("rows.jsonl", data)
        shard_size = rng.choice([1, 2, 3, 7, 50, 1000])
        shards = plan_jsonl_shards(local_store, "rows.jsonl", shard_size)
        assert [s.index for s in shards] == list(range(len(shards)))
        assert shards[0].byte_start == 0 and shards[-1].byte_end == len(data)
        assert all(a.byte_end == b.byte_start for a, b in zip(shards, shards[1:], strict=False))
        spec = SPEC.model_copy(update={"shard_size": shard_size})
        numbers = []
        for shard in shards:
            for item in read_shard_rows(local_store, "rows.jsonl", spec, shard):
                assert isinstance(item, Row)
                numbers.append(json.loads(data[item.index:].split(b"\n", 1)[0])["n"])
        assert numbers == list(range(len(rows)))


def test_small_files_are_planned_exactly_at_line_starts(local_store) -> None:
    data = b"".join(json.dumps({"q": f"row {n}"}).encode() + b"\n" for n in range(10)) + b"\n\n"
    local_store.put_bytes("rows.jsonl", data)
    shards = plan_shards(local_store, "rows.jsonl", SPEC.model_copy(update={"shard_size": 4}))
    assert [(s.estimated_rows, s.rows_exact) for s in shards] == [(4, True), (4, True), (2, True)]
    assert [sum(1 for _ in read_shard_rows(local_store, "rows.jsonl", SPEC, s)) for s in shards] == [4, 4, 2]
    for shard in shards[1:]:
        assert data[shard.byte_start - 1:shard.byte_start] == b"\n"


def test_an_empty_file_has_one_empty_shard(local_store) -> None:
    local_store.put_bytes("rows.jsonl", b"")
    [shard] = plan_shards(local_store, "rows.jsonl", SPEC)
    assert (shard.byte_start, shard.byte_end, shard.estimated_rows) == (0, 0, 0)
    assert list(read_shard_rows(local_store, "rows.jsonl", SPEC, shard)) == []


def test_malformed_lines_become_row_errors_with_their_line_numbers(local_store) -> None:
    lines = [b'{"q": "fine"}', b'{"q": "broken', b"", b"[1, 2]", b'{"q": "\xff\xfe"}', b'{"other": 1}',
             b'{"q": "last, no newline"}']
    local_store.put_bytes("rows.jsonl", b"\n".join(lines))
    items = list(iter_jsonl_rows(local_store, "rows.jsonl", 0, 10_000, RowBuilder(SPEC)))
    assert len(items) == 6  # every line but the blank one, none dropped
    kinds = [(type(item).__name__, getattr(item, "code", None), item.line) for item in items]
    assert kinds == [("Row", None, 1), ("RowError", RowErrorCode.INVALID_JSON, 2),
                     ("RowError", RowErrorCode.INVALID_ROW, 4), ("RowError", RowErrorCode.INVALID_JSON, 5),
                     ("RowError", RowErrorCode.MISSING_COLUMN, 6), ("Row", None, 7)]
    broken = items[1]
    assert isinstance(broken, RowError)
    assert broken.message.startswith(f"line 2 of the shard (byte {len(lines[0]) + 1}): invalid JSON")
    assert "a JSON list where an object was expected" in items[2].message
    assert "prompt_column 'q' is missing in this row" in items[4].message
    assert items[-1].prompt == "last, no newline"


def test_crlf_lines_and_a_byte_order_mark_are_read_as_plain_lines(local_store) -> None:
    local_store.put_bytes("rows.jsonl", b'\xef\xbb\xbf{"q": "a"}\r\n{"q": "b"}\r\n')
    rows = list(iter_jsonl_rows(local_store, "rows.jsonl", 0, 100, RowBuilder(SPEC)))
    assert [row.prompt for row in rows] == ["a", "b"]


def test_byte_range_reads_work_the_same_on_s3(s3_store) -> None:
    rng = random.Random(7)
    data = b"".join(json.dumps({"q": "y" * rng.randint(0, 80)}).encode() + b"\n" for _ in range(200))
    s3_store.put_bytes("rows.jsonl", data)
    shards = plan_shards(s3_store, "rows.jsonl", SPEC.model_copy(update={"shard_size": 17}))
    offsets = [row.index for shard in shards for row in read_shard_rows(s3_store, "rows.jsonl", SPEC, shard)]
    assert offsets == [offset for offset, _ in expected_lines(data)]


@pytest.mark.parametrize("start, end", [(0, 0), (5, 5), (10, 3)])
def test_an_empty_range_owns_no_lines(local_store, start, end) -> None:
    local_store.put_bytes("rows.jsonl", b'{"q": 1}\n{"q": 2}\n')
    assert list(iter_lines_in_range(local_store, "rows.jsonl", start, end)) == []


@pytest.mark.parametrize("chunk_size", [7, 4096, 1 << 20])
def test_an_overlong_line_is_skipped_unread_and_reported_by_size_wherever_the_cut(local_store,
                                                                                 chunk_size: int) -> None:
    long_line = b'{"q": "' + b"x" * 20_000 + b'"}'
    lines = [b'{"q": "a"}', long_line, b'{"q": "b"}', long_line]  # the last one has no newline
    data = b"\n".join(lines)
    local_store.put_bytes("long.jsonl", data)
    got = []
    for start, end in [(0, 5), (5, 20_000), (20_000, len(data))]:  # cuts inside the long lines
        got += list(iter_lines_in_range(local_store, "long.jsonl", start, end, chunk_size=chunk_size,
                                        max_line_bytes=1000))
    assert [(line.offset, line.data, line.too_long) for line in got] == [
        (0, lines[0], 0), (11, b"", len(long_line)), (12 + len(long_line), lines[2], 0),
        (23 + len(long_line), b"", len(long_line))]


def test_an_overlong_jsonl_line_is_that_rows_error(local_store, monkeypatch: pytest.MonkeyPatch) -> None:
    from bulkinfer.jobs.formats import lines

    monkeypatch.setattr(lines, "MAX_LINE_BYTES", 1000)
    monkeypatch.setattr(lines.iter_lines_in_range, "__defaults__", (lines.READ_CHUNK_BYTES, 1000))
    data = b'{"q": "a"}\n{"q": "' + b"y" * 5000 + b'"}\n{"q": "b"}\n'
    local_store.put_bytes("rows.jsonl", data)
    spec = JobSpec(input_uri="s3://b/rows.jsonl", model="m", prompt_column="q")
    items = list(iter_jsonl_rows(local_store, "rows.jsonl", 0, len(data), RowBuilder(spec)))
    assert [type(item) for item in items] == [Row, RowError, Row]
    assert items[1].code == RowErrorCode.INVALID_ROW and "5,009 bytes" in items[1].message


def test_a_rows_deeply_nested_schema_is_that_rows_error(local_store) -> None:
    schema: dict = {"type": "string"}
    for _ in range(40):
        schema = {"type": "array", "items": schema}
    lines = [{"q": "fine"}, {"q": "deep", "format": {"type": "json_schema",
                                                     "json_schema": {"name": "deep", "schema": schema}}}]
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    local_store.put_bytes("rows.jsonl", data)
    spec = JobSpec(input_uri="s3://b/rows.jsonl", model="m", prompt_column="q",
                   response_format_column="format")
    items = list(iter_jsonl_rows(local_store, "rows.jsonl", 0, len(data), RowBuilder(spec)))
    assert isinstance(items[0], Row) and isinstance(items[1], RowError)
    assert items[1].code == RowErrorCode.INVALID_RESPONSE_FORMAT and "at most 32" in items[1].message
