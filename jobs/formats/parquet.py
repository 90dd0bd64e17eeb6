"""Parquet input: a shard reads only its row groups, and only the columns the spec uses."""

from __future__ import annotations

from collections.abc import Iterator

from jobs.formats.rows import Row, RowBuilder, RowError
from jobs.object_store.base import ObjectStore
from jobs.sharding import ShardPlan, open_parquet

BATCH_ROWS = 1024


def iter_parquet_rows(store: ObjectStore, key: str, shard: ShardPlan,
                      builder: RowBuilder) -> Iterator[Row | RowError]:
    """Rows `[row_start, row_end)` of the shard's row groups, in file order.

    A column the spec names but the file lacks reads as absent, so each row reports it (the
    planner already refused files that lack a column every row needs).
    """
    if not shard.row_groups:
        return
    with open_parquet(store, key) as parquet:
        names = set(parquet.schema_arrow.names)
        columns = [column for column in builder.spec.input_columns() if column in names]
        metadata = parquet.metadata
        index = sum(metadata.row_group(group).num_rows for group in range(shard.row_groups[0]))
        start, end = shard.row_start or 0, shard.row_end if shard.row_end is not None else float("inf")
        for batch in parquet.iter_batches(batch_size=BATCH_ROWS, row_groups=shard.row_groups,
                                          columns=columns, use_threads=False):
            if index + batch.num_rows <= start:
                index += batch.num_rows
                continue
            records = batch.to_pylist() if columns else [{}] * batch.num_rows
            for record in records:
                if start <= index < end:
                    yield builder.build(index, record)
                index += 1
            if index >= end:
                return
