"""Parquet input: a shard reads only its row groups, and only the columns the spec uses."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from bulkinfer.jobs.formats.rows import Row, RowBuilder, RowError, RowErrorCode
from bulkinfer.jobs.object_store.base import ObjectStore
from bulkinfer.jobs.planning.sharding import ShardPlan, open_parquet

if TYPE_CHECKING:
    import pyarrow as pa

BATCH_ROWS = 1024


@dataclass(frozen=True, slots=True)
class UnreadableCell:
    """A row with a cell Python cannot hold: a string that is not UTF-8, a date out of range…"""

    reason: str


def batch_records(batch: pa.RecordBatch) -> list[dict[str, Any] | UnreadableCell]:
    """The batch's rows as dicts. Arrow checks no string's UTF-8 when it reads Parquet, so a bad
    cell shows only when converted: then the batch is converted cell by cell, and only the rows
    with such a cell come back as `UnreadableCell` (the others as usual)."""
    try:
        return batch.to_pylist()
    except Exception:  # noqa: BLE001 - UnicodeDecodeError, ValueError (dates), OverflowError…
        return [_row_record(batch, row) for row in range(batch.num_rows)]


def _row_record(batch: pa.RecordBatch, row: int) -> dict[str, Any] | UnreadableCell:
    record = {}
    for name, column in zip(batch.schema.names, batch.columns, strict=True):
        try:
            record[name] = column[row].as_py()
        except UnicodeDecodeError as error:
            return UnreadableCell(f"column {name!r} holds text that is not UTF-8 ({error.reason} at byte "
                                  f"{error.start})")
        except Exception as error:  # noqa: BLE001 - any other value Python cannot represent
            return UnreadableCell(f"column {name!r} holds a value that cannot be read "
                                  f"({type(error).__name__}: {str(error)[:200]})")
    return record


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
            for record in batch_records(batch) if columns else [{}] * batch.num_rows:
                if start <= index < end:
                    yield builder.build(index, record) if isinstance(record, dict) else \
                        RowError(index, str(index), RowErrorCode.INVALID_ROW, record.reason)
                index += 1
            if index >= end:
                return
