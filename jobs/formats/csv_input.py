"""CSV and TSV input: a shard reads only the records that start in its byte range (as the planner
cut them, jobs/formats/csv_records.py), and pyarrow's CSV reader parses them a block at a time with
the header's column names.

Every cell the job reads is text exactly as written (an id "007" stays "007", a template shows
"3.50" as the file has it); an empty cell is null. A block pyarrow refuses is parsed again in
halves, so a row it cannot read (a field too many, a quote never closed, bytes the encoding has no
character for) becomes that row's error, in its place, and the rows around it run.
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from bulkinfer.jobs.formats.csv_dialect import CsvDialect
from bulkinfer.jobs.formats.csv_header import read_header
from bulkinfer.jobs.formats.csv_records import Record, blocks, iter_records
from bulkinfer.jobs.formats.parquet import UnreadableCell, batch_records
from bulkinfer.jobs.formats.rows import Row, RowBuilder, RowError, RowErrorCode
from bulkinfer.jobs.object_store.base import ObjectStore
from bulkinfer.jobs.planning.sharding import ShardPlan

if TYPE_CHECKING:
    import pyarrow as pa

MESSAGE_CHARS = 300
_BLOCK_ROW_NUMBER = re.compile(r"Row #\d+: ")  # pyarrow counts from the block, not the file: misleading
Parsed = dict[str, Any] | UnreadableCell | str  # a row's cells, a cell Python cannot hold, or why not a row


def iter_csv_rows(store: ObjectStore, key: str, shard: ShardPlan,
                  builder: RowBuilder) -> Iterator[Row | RowError]:
    """The shard's rows in file order, numbered from its `row_start` (the row's index in the file)."""
    if shard.byte_start is None or shard.byte_end is None:
        raise ValueError(f"shard {shard.shard_id} has no byte range; it was not planned for CSV")
    spec = builder.spec
    dialect = CsvDialect.of_input(spec)
    header = read_header(store, key, dialect)
    used = [column for column in spec.input_columns() if column in header.names]
    parser = BlockParser(dialect, header.names, used)
    index = shard.row_start or 0
    records = iter_records(store, key, shard.byte_start, shard.byte_end, dialect.delimiter_bytes)
    for block in blocks(records):
        for record, parsed in zip(block, parser.parse(block), strict=True):
            yield _item(builder, index, record, parsed, dialect)
            index += 1


class BlockParser:
    """Records → one parsed value each, by pyarrow, every column read as text."""

    def __init__(self, dialect: CsvDialect, names: list[str], columns: list[str]) -> None:
        import pyarrow as pa
        import pyarrow.csv as pa_csv

        self.dialect = dialect
        self.names = names
        self.columns = columns
        # Parse errors show in any column; with no column used, one is converted (and ignored).
        include = columns or names[:1]
        self.convert = pa_csv.ConvertOptions(
            column_types={column: pa.string() for column in include}, include_columns=include,
            strings_can_be_null=True, quoted_strings_can_be_null=True, null_values=[""],
            check_utf8=False)  # a cell that is not UTF-8 fails its row only (batch_records)

    def parse(self, records: list[Record]) -> list[Parsed]:
        parsed: list[Parsed] = []
        run: list[Record] = []
        for record in records:
            if record.malformed:
                parsed += self._parse_run(run)
                run = []
                parsed.append(record.malformed)
            else:
                run.append(record)
        return parsed + self._parse_run(run)

    def _parse_run(self, records: list[Record]) -> list[Parsed]:
        if not records:
            return []
        table, problem = self._table(b"".join(record.data for record in records))
        if table is not None and table.num_rows != len(records):
            problem = f"it reads as {table.num_rows} rows"
        if problem is None and table is not None:
            if not self.columns:
                return [{} for _ in records]
            return [value for batch in table.to_batches() for value in batch_records(batch)]
        if len(records) == 1:
            return [problem or "it cannot be read"]
        half = len(records) // 2
        return self._parse_run(records[:half]) + self._parse_run(records[half:])

    def _table(self, data: bytes) -> tuple[pa.Table | None, str | None]:
        import pyarrow as pa
        import pyarrow.csv as pa_csv

        try:
            read_options = self.dialect.read_options(self.names, len(data))
            table = pa_csv.read_csv(io.BytesIO(data), read_options=read_options,
                                    parse_options=self.dialect.parse_options(), convert_options=self.convert)
            return table, None
        except (pa.ArrowException, ValueError) as error:  # UnicodeDecodeError: a byte the encoding lacks
            return None, _BLOCK_ROW_NUMBER.sub("", str(error))[:MESSAGE_CHARS]


def _item(builder: RowBuilder, index: int, record: Record, parsed: Parsed,
          dialect: CsvDialect) -> Row | RowError:
    if isinstance(parsed, dict):
        return builder.build(index, parsed)
    where = f"the row at byte {record.offset}"
    if isinstance(parsed, UnreadableCell):
        not_utf8 = "UTF-8" in parsed.reason
        hint = f" (set csv_encoding if the file is not {dialect.encoding})" if not_utf8 else ""
        return RowError(index, str(index), RowErrorCode.INVALID_ROW, f"{where}: {parsed.reason}{hint}")
    return RowError(index, str(index), RowErrorCode.INVALID_ROW, f"{where} cannot be read as CSV: {parsed}")
