"""CSV and TSV output parts: the columns of a Parquet part (`parquet_writer.output_table`,
`embedding_writer.embedding_table`) written by pyarrow's CSV writer, UTF-8 with a header row.

A cell holds text, so a nested value (`logprobs`, `choices`, `prompt_logprobs`, an embedding, a list
passed through) is written as its JSON text, in the shape a JSONL output line gives it (token bytes
as a list of numbers); a null is an empty cell and an empty text is `""`.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import pyarrow as pa


def csv_ready(table: pa.Table) -> pa.Table:
    """The table with every column CSV cannot hold as it is turned into text: nested values as JSON,
    bytes as UTF-8 text (undecodable bytes replaced)."""
    import pyarrow as pa

    for position, column in enumerate(table.columns):
        kind = column.type
        if pa.types.is_nested(kind):
            text = [None if value is None else json.dumps(value, ensure_ascii=False, default=_json_default)
                    for value in column.to_pylist()]
        elif _is_binary(kind):
            text = [None if value is None else value.decode("utf-8", "replace")
                    for value in column.to_pylist()]
        else:
            continue
        table = table.set_column(position, table.field(position).name, pa.array(text, pa.string()))
    return table


def _is_binary(kind: pa.DataType) -> bool:
    import pyarrow as pa

    return pa.types.is_binary(kind) or pa.types.is_large_binary(kind) or pa.types.is_fixed_size_binary(kind)


def _json_default(value: Any) -> Any:
    if isinstance(value, bytes):
        return list(value)  # as JSONL writes a token's bytes
    return str(value)  # dates, decimals: as JSONL writes them


class BytesSink(Protocol):
    def write(self, data: bytes, /) -> int: ...


def write_csv(table: pa.Table, sink: BytesSink, delimiter: str = ",", include_header: bool = True) -> None:
    """The table as CSV (TSV with a tab `delimiter`) into `sink`; every text value quoted."""
    import pyarrow.csv as pa_csv

    options = pa_csv.WriteOptions(include_header=include_header, delimiter=delimiter)
    pa_csv.write_csv(csv_ready(table), sink, options)
