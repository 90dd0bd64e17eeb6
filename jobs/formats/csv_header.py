"""A CSV or TSV file's header row: the column names, and where the data rows start."""

from __future__ import annotations

import io
import sys
from collections import Counter
from contextlib import closing
from dataclasses import dataclass

from bulkinfer.jobs.errors import InputError
from bulkinfer.jobs.formats.csv_dialect import CsvDialect
from bulkinfer.jobs.formats.csv_records import header_offset, iter_records
from bulkinfer.jobs.object_store.base import ObjectStore
from bulkinfer.jobs.spec import JobSpec

HEADER_CHUNK_BYTES = 64 << 10  # every shard reads the header again: read little more than it
NAMES_SHOWN = 20  # columns a message lists before it says how many more there are
NO_HEADER = "a CSV file's first row must name its columns"


@dataclass(frozen=True)
class CsvHeader:
    names: list[str]
    data_start: int  # byte offset of the first data row (or of the end of the file)

    def listing(self) -> str:
        shown = ", ".join(repr(name) for name in self.names[:NAMES_SHOWN])
        more = len(self.names) - NAMES_SHOWN
        return shown + (f" and {more} more" if more > 0 else "")


def read_header(store: ObjectStore, key: str, dialect: CsvDialect, name: str = "the file") -> CsvHeader:
    """The first non-empty row, read as column names; `InputError` (naming the input as `name`) when
    there is none to read."""
    start = header_offset(store, key, skip_bom=dialect.is_utf8)
    records = iter_records(store, key, start, sys.maxsize, dialect.delimiter_bytes,
                           chunk_size=HEADER_CHUNK_BYTES)
    with closing(records):
        record = next(records, None)
    if record is None:
        raise InputError(f"{name} has no header row: {NO_HEADER}")
    if record.malformed:
        raise InputError(f"the header row of {name} cannot be read: {record.malformed}")
    import pyarrow as pa
    import pyarrow.csv as pa_csv

    text = record.data if record.data.endswith((b"\n", b"\r")) else record.data + b"\n"
    try:
        names = pa_csv.read_csv(io.BytesIO(text), read_options=dialect.read_options(None, len(text)),
                                parse_options=dialect.parse_options()).column_names
    except (pa.ArrowException, ValueError) as error:  # UnicodeDecodeError too: a wrong csv_encoding
        hint = ("if the file is not UTF-8, set csv_encoding (e.g. cp1252)" if dialect.is_utf8 else
                f"is the file really {dialect.encoding}? (csv_encoding)")
        raise InputError(f"the header row of {name} cannot be read ({str(error)[:300]}); {hint}") from None
    return CsvHeader(names, record.offset + len(record.data))


def check_header(spec: JobSpec, header: CsvHeader, name: str = "the file") -> None:
    """`InputError` naming a column every row needs that the header lacks, or one the job reads
    that the header names twice (which of the two would be ambiguous)."""
    for column in spec.required_columns():
        if column not in header.names:
            raise InputError(f"column {column!r} is not in the header row of {name} (its columns: "
                             f"{header.listing()}); {NO_HEADER}")
    repeated = sorted(column for column, count in Counter(header.names).items()
                      if count > 1 and column in spec.input_columns())
    if repeated:
        raise InputError(f"the header row of {name} names column {repeated[0]!r} more than once")
