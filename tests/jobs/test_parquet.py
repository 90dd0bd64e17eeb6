"""Parquet shards: planned from the footer, read by range requests for only their row groups."""

from __future__ import annotations

import hashlib

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bulkinfer.jobs.errors import InputError
from bulkinfer.jobs.formats.readers import read_shard_rows
from bulkinfer.jobs.formats.rows import Row, RowError
from bulkinfer.jobs.planning.sharding import plan_row_groups, plan_shards
from bulkinfer.jobs.spec import JobSpec

SPEC = JobSpec(input_uri="s3://b/rows.parquet", input_format="parquet", model="m",
               template="Translate: {text}", id_column="doc_id", passthrough_columns=["lang"])


def parquet_bytes(rows: int, row_group_size: int, tmp_path) -> bytes:
    table = pa.table({
        "doc_id": [f"d{n}" for n in range(rows)],
        "text": [f"sentence number {n} " * 3 if n % 17 else None for n in range(rows)],
        "lang": ["fr" if n % 2 else "de" for n in range(rows)],
        # A column no shard reads: big and incompressible, so fetching it by mistake would show.
        "unused_blob": ["".join(hashlib.sha256(f"{n}-{i}".encode()).hexdigest() for i in range(16))
                        for n in range(rows)],
    })
    path = tmp_path / "rows.parquet"
    pq.write_table(table, path, row_group_size=row_group_size)
    return path.read_bytes()


def test_row_groups_are_gathered_into_shards_and_big_ones_split() -> None:
    shards = plan_row_groups([10, 10, 10, 10, 10, 100, 3], shard_size=25)
    assert [(s.row_groups, s.row_start, s.row_end) for s in shards] == [
        ([0, 1, 2], 0, 30), ([3, 4], 30, 50),
        ([5], 50, 75), ([5], 75, 100), ([5], 100, 125), ([5], 125, 150),
        ([6], 150, 153)]
    assert [s.index for s in shards] == list(range(7)) and all(s.rows_exact for s in shards)
    [empty] = plan_row_groups([], shard_size=25)
    assert (empty.row_groups, empty.estimated_rows) == ([], 0)


def test_shards_round_trip_every_row_once_with_row_errors_in_place(store, tmp_path) -> None:
    store.put_bytes("rows.parquet", parquet_bytes(230, 20, tmp_path))
    shards = plan_shards(store, "rows.parquet", SPEC.model_copy(update={"shard_size": 50}))
    assert sum(shard.estimated_rows for shard in shards) == 230
    items = [item for shard in shards for item in read_shard_rows(store, "rows.parquet", SPEC, shard)]
    assert [item.index for item in items] == list(range(230))
    assert [item.row_id for item in items] == [f"d{n}" for n in range(230)]
    errors = [item for item in items if isinstance(item, RowError)]
    assert [error.index for error in errors] == [n for n in range(230) if n % 17 == 0]
    assert errors[0].message == "template column 'text' is null in the row"
    row = items[1]
    assert isinstance(row, Row) and row.prompt == "Translate: " + "sentence number 1 " * 3
    assert row.passthrough == {"lang": "fr"}


def test_a_row_range_inside_a_big_row_group_reads_just_those_rows(local_store, tmp_path) -> None:
    local_store.put_bytes("rows.parquet", parquet_bytes(100, 100, tmp_path))
    shards = plan_shards(local_store, "rows.parquet", SPEC.model_copy(update={"shard_size": 30}))
    assert [(s.row_start, s.row_end) for s in shards] == [(0, 30), (30, 60), (60, 90), (90, 100)]
    indexes = [item.index for item in read_shard_rows(local_store, "rows.parquet", SPEC, shards[2])]
    assert indexes == list(range(60, 90))


def test_a_shard_fetches_only_the_footer_and_its_own_column_chunks(s3_store, tmp_path) -> None:
    data = parquet_bytes(400, 20, tmp_path)  # twenty row groups, ~20 KiB of unused_blob each
    s3_store.put_bytes("rows.parquet", data)
    metadata = pq.ParquetFile(pa.BufferReader(data)).metadata
    shards = plan_shards(s3_store, "rows.parquet", SPEC.model_copy(update={"shard_size": 40}))
    shard = shards[2]
    assert shard.row_groups == [4, 5]

    def chunk_ranges(groups, columns) -> list[tuple[int, int]]:
        ranges = []
        for group in groups:
            for position in range(metadata.num_columns):
                chunk = metadata.row_group(group).column(position)
                if chunk.path_in_schema in columns:
                    start = chunk.dictionary_page_offset or chunk.data_page_offset
                    ranges.append((start, start + chunk.total_compressed_size))
        return ranges

    reads: list[tuple[int, int]] = []
    real_read_range = s3_store.read_range

    def counting_read_range(key, start, end):
        reads.append((start, end))
        return real_read_range(key, start, end)

    s3_store.read_range = counting_read_range
    rows = list(read_shard_rows(s3_store, "rows.parquet", SPEC, shard))
    assert [row.index for row in rows] == list(range(80, 120))

    needed = chunk_ranges([4, 5], {"doc_id", "text", "lang"})
    unneeded = chunk_ranges([4, 5], {"unused_blob"}) + chunk_ranges(
        [group for group in range(20) if group not in (4, 5)], {"doc_id", "text", "lang", "unused_blob"})
    footer_reads = [(start, end) for start, end in reads if end == len(data)]
    assert len(footer_reads) == 1  # pyarrow's one speculative read of the file's tail
    for start, end in reads:
        if (start, end) not in footer_reads:
            assert not any(start < b and a < end for a, b in unneeded), (start, end)
    assert all(any(s <= a and b <= e for s, e in reads) for a, b in needed)  # each chunk was fetched
    assert sum(end - start for start, end in reads) < len(data) / 3


def test_a_missing_required_column_fails_planning_with_the_columns_listed(local_store, tmp_path) -> None:
    local_store.put_bytes("rows.parquet", parquet_bytes(10, 5, tmp_path))
    spec = SPEC.model_copy(update={"template": "{title}"})
    expected = r"column 'title' is not in the Parquet file \(its columns: doc_id, text"
    with pytest.raises(InputError, match=expected):
        plan_shards(local_store, "rows.parquet", spec)


def test_a_file_that_is_not_parquet_is_an_input_error(local_store) -> None:
    local_store.put_bytes("rows.parquet", b'{"q": "this is JSON"}\n')
    with pytest.raises(InputError, match="rows.parquet is not a readable Parquet file"):
        plan_shards(local_store, "rows.parquet", SPEC)


def test_a_truncated_parquet_file_is_an_input_error(local_store, tmp_path) -> None:
    """An upload cut short keeps the leading magic bytes but loses the footer: planning says so."""
    data = parquet_bytes(40, 10, tmp_path)
    local_store.put_bytes("rows.parquet", data[: len(data) // 2])
    with pytest.raises(InputError, match="rows.parquet is not a readable Parquet file"):
        plan_shards(local_store, "rows.parquet", SPEC)
