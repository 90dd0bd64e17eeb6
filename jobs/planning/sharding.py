"""Shard planning: cut an input into shards a worker can read alone, deterministically.

JSONL is cut into byte ranges of `shard_size` rows, counted in one streaming pass
(`formats.row_starts`; `formats.lines` gives each line to exactly one range). CSV and TSV likewise, by
record starts that respect quoting (`formats.csv_records`), and their shards also carry the range's
row numbers. Parquet is cut along row groups, taken whole where they are small and split into row
ranges where one holds many shards' rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict

from bulkinfer.jobs.errors import InputError
from bulkinfer.jobs.object_store.base import ObjectStore
from bulkinfer.jobs.spec import DELIMITED_FORMATS, InputFormat, JobSpec, file_name

if TYPE_CHECKING:
    import pyarrow.parquet as pq

class ShardPlan(BaseModel):
    """One unit of work. JSONL shards set `byte_start`/`byte_end`; Parquet shards `row_groups`
    and the global row range `[row_start, row_end)`; CSV shards both byte and row ranges.
    `estimated_rows` is exact for all (a retry's or an older plan's may say `rows_exact=False`).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    index: int
    estimated_rows: int
    rows_exact: bool
    byte_start: int | None = None
    byte_end: int | None = None
    row_groups: list[int] = []
    row_start: int | None = None
    row_end: int | None = None
    # OpenAI batch input: byte offset of each of the shard's lines that repeats a custom_id first
    # used earlier in the file -> that first line's number (those lines become row errors).
    repeated_custom_ids: dict[int, int] = {}
    # A retry job (jobs/planning/retry.py) runs only these rows of the range, by `Row.index` (None: all of
    # them), and `origin_shard` is the index of the shard of the first job in its chain that covers
    # the same range, so results can be merged across the chain one range at a time.
    only_rows: list[int] | None = None
    origin_shard: int | None = None
    # Identical rows across shards (jobs/planning/job_dedup.py): position in this shard -> [source shard,
    # position there], and this shard's positions whose outcomes later shards copy.
    copies: dict[int, list[int]] = {}
    exports: list[int] = []

    @property
    def origin(self) -> int:
        return self.index if self.origin_shard is None else self.origin_shard

    @property
    def shard_id(self) -> str:
        return f"{self.index:05d}"


def plan_shards(store: ObjectStore, key: str, spec: JobSpec) -> list[ShardPlan]:
    """At least one shard (an empty input has one empty shard), numbered from 0 in input order."""
    return with_file_checks(store, key, spec, plan_ranges(store, key, spec))


def plan_ranges(store: ObjectStore, key: str, spec: JobSpec) -> list[ShardPlan]:
    """The shards' ranges of rows, without the checks across the whole file (`with_file_checks`)."""
    if spec.input_format is None:
        raise ValueError("plan_shards needs a resolved input_format (see formats.detect.resolve_spec)")
    if spec.input_format == InputFormat.PARQUET:
        return plan_parquet_shards(store, key, spec)
    if spec.input_format in DELIMITED_FORMATS:
        return plan_csv_shards(store, key, spec)
    return plan_jsonl_shards(store, key, spec.shard_size)


def with_file_checks(store: ObjectStore, key: str, spec: JobSpec, shards: list[ShardPlan]) -> list[ShardPlan]:
    """The plan with what one pass over the whole file finds (an OpenAI batch file's repeated
    custom_ids); the same whatever the shards' size."""
    if spec.input_format == InputFormat.OPENAI_BATCH:
        return _with_repeated_custom_ids(store, key, shards)
    return shards


def _with_repeated_custom_ids(store: ObjectStore, key: str, shards: list[ShardPlan]) -> list[ShardPlan]:
    """custom_ids must be unique in the whole file (as OpenAI's batch API requires): one pass at
    planning finds the lines that repeat one, and each shard's plan lists its own."""
    from bulkinfer.jobs.formats.openai_batch import repeated_custom_id_lines

    repeated = repeated_custom_id_lines(store, key)
    if not repeated:
        return shards
    planned = []
    for shard in shards:
        start, end = shard.byte_start or 0, shard.byte_end or 0
        own = {offset: first for offset, first in repeated.items() if start <= offset < end}
        planned.append(shard.model_copy(update={"repeated_custom_ids": own}) if own else shard)
    return planned


def plan_jsonl_shards(store: ObjectStore, key: str, shard_size: int) -> list[ShardPlan]:
    """Byte ranges of exactly `shard_size` rows (the last one fewer), cut at real row starts by one
    streaming pass over the file: every count a limit reads is exact, and no shard holds more rows
    than asked, whatever the lengths of its lines."""
    from bulkinfer.jobs.formats.row_starts import count_row_starts

    size = store.head(key).size
    starts = count_row_starts(store, key, shard_size)
    ranges = zip(starts.cuts, [*starts.cuts[1:], size], starts.shard_rows(), strict=True)
    return [ShardPlan(index=index, estimated_rows=rows, rows_exact=True, byte_start=start, byte_end=end)
            for index, (start, end, rows) in enumerate(ranges)]


def plan_csv_shards(store: ObjectStore, key: str, spec: JobSpec) -> list[ShardPlan]:
    """Byte ranges of exactly `shard_size` rows (the last one fewer) after the header row, cut at
    record starts by one streaming pass. Raises `InputError` if the header lacks a column every row
    needs."""
    from bulkinfer.jobs.formats.csv_dialect import CsvDialect
    from bulkinfer.jobs.formats.csv_header import check_header, read_header
    from bulkinfer.jobs.formats.csv_records import count_records

    dialect = CsvDialect.of_input(spec)
    header = read_header(store, key, dialect)
    check_header(spec, header)
    size = store.head(key).size
    counts = count_records(store, key, header.data_start, size, dialect.delimiter_bytes, spec.shard_size)
    ranges = zip(counts.cuts, [*counts.cuts[1:], size], counts.shard_rows(), strict=True)
    return [ShardPlan(index=index, estimated_rows=rows, rows_exact=True, byte_start=start, byte_end=end,
                      row_start=index * spec.shard_size, row_end=index * spec.shard_size + rows)
            for index, (start, end, rows) in enumerate(ranges)]


@contextmanager
def open_parquet(store: ObjectStore, key: str) -> Iterator[pq.ParquetFile]:
    """A ParquetFile over range reads; raises `InputError` if the object is not Parquet."""
    import pyarrow.parquet as pq

    with store.open_seekable(key) as file:
        try:
            parquet = pq.ParquetFile(file)
        except Exception as error:  # pyarrow raises several types for a bad footer
            raise InputError(f"{file_name(key)} is not a readable Parquet file: {error}") from None
        yield parquet


def plan_parquet_shards(store: ObjectStore, key: str, spec: JobSpec) -> list[ShardPlan]:
    """Reads only the footer. Raises `InputError` if a column every row needs is absent."""
    with open_parquet(store, key) as parquet:
        metadata = parquet.metadata
        names = parquet.schema_arrow.names
    absent = [column for column in spec.required_columns() if column not in names]
    if absent:
        raise InputError(f"column {absent[0]!r} is not in the Parquet file (its columns: {', '.join(names)})")
    group_rows = [metadata.row_group(group).num_rows for group in range(metadata.num_row_groups)]
    return plan_row_groups(group_rows, spec.shard_size)


def plan_row_groups(group_rows: list[int], shard_size: int) -> list[ShardPlan]:
    """Small row groups are gathered until a shard holds `shard_size` rows; a group with at least
    two shards' worth of rows is split into row ranges (each such shard reads the whole group).
    """
    shards: list[ShardPlan] = []
    pending: list[int] = []
    pending_start = first_row = 0

    def emit(groups: list[int], start: int, end: int) -> None:
        shards.append(ShardPlan(index=len(shards), estimated_rows=end - start, rows_exact=True,
                                row_groups=groups, row_start=start, row_end=end))

    for group, rows in enumerate(group_rows):
        if rows >= 2 * shard_size:
            if pending:
                emit(pending, pending_start, first_row)
                pending = []
            for offset in range(0, rows, shard_size):
                emit([group], first_row + offset, first_row + min(rows, offset + shard_size))
        else:
            if not pending:
                pending_start = first_row
            pending.append(group)
            if first_row + rows - pending_start >= shard_size:
                emit(pending, pending_start, first_row + rows)
                pending = []
        first_row += rows
    if pending or not shards:
        emit(pending, pending_start if pending else first_row, first_row)
    return shards
