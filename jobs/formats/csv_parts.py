"""CSV and TSV output parts read back (a results download, a merged retry chain, the SDK), a block of
rows at a time: text stays text ("" apart from an empty cell, which is null), the token counts are
integers, and the JSON a nested cell holds (`logprobs`, `choices`, an embedding…) is decoded, so a
row reads as it does from a Parquet part.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, BinaryIO

from bulkinfer.jobs.formats.csv_dialect import CsvDialect
from bulkinfer.jobs.formats.csv_records import blocks, stream_records

if TYPE_CHECKING:
    import pyarrow as pa

INTEGER_COLUMNS = frozenset({"prompt_tokens", "cached_tokens", "completion_tokens", "reasoning_tokens"})
JSON_COLUMNS = frozenset({"logprobs", "choices", "prompt_logprobs", "embedding", "embeddings"})


def part_tables(stream: BinaryIO, file_format: str, *, as_text: bool = False) -> Iterator[pa.Table]:
    """The part's rows, a table a block; `as_text`: every column as the text the part holds."""
    import pyarrow as pa
    import pyarrow.csv as pa_csv

    dialect = CsvDialect.of(file_format)
    records = stream_records(stream, dialect.delimiter_bytes)
    header = next(records, None)
    if header is None:
        return
    read_options = dialect.read_options(None, len(header.data))
    names = pa_csv.read_csv(io.BytesIO(header.data), read_options=read_options,
                            parse_options=dialect.parse_options()).column_names
    types = {name: pa.int64() if name in INTEGER_COLUMNS and not as_text else pa.string() for name in names}
    convert = pa_csv.ConvertOptions(column_types=types, strings_can_be_null=True, null_values=[""],
                                    quoted_strings_can_be_null=False)
    empty = True
    for block in blocks(records):
        data = b"".join(record.data for record in block)
        empty = False
        yield pa_csv.read_csv(io.BytesIO(data), read_options=dialect.read_options(names, len(data)),
                              parse_options=dialect.parse_options(), convert_options=convert)
    if empty:  # a part of no rows still has its columns
        yield pa.table({name: pa.array([], kind) for name, kind in types.items()})


def table_rows(table: pa.Table) -> list[dict[str, Any]]:
    """The table's rows as dicts, nested cells decoded from their JSON."""
    rows = table.to_pylist()
    nested = JSON_COLUMNS.intersection(table.column_names)
    for row in rows:
        for name in nested:
            if row[name] is not None:
                row[name] = json.loads(row[name])
    return rows


def part_rows(stream: BinaryIO, file_format: str) -> Iterator[list[dict[str, Any]]]:
    """The part's rows as dicts, a list a block."""
    for table in part_tables(stream, file_format):
        yield table_rows(table)
