"""JSONL input: one JSON object per line, read by byte range (see `formats.lines`)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from bulkinfer.jobs.formats.json_text import UnreadableJson, loads_untrusted
from bulkinfer.jobs.formats.lines import MAX_LINE_BYTES, Line, iter_lines_in_range
from bulkinfer.jobs.formats.rows import Row, RowBuilder, RowError, RowErrorCode
from bulkinfer.jobs.object_store.base import ObjectStore


def decode_object_line(line: Line) -> dict[str, Any] | RowError:
    """The line's JSON object, or the per-row error that says why it is not one."""
    where = f"line {line.number} of the shard (byte {line.offset})"
    if line.too_long:
        return RowError(line.offset, str(line.offset), RowErrorCode.INVALID_ROW,
                        f"{where}: the line is {line.too_long:,} bytes, over the {MAX_LINE_BYTES >> 20} MiB "
                        "a row may have (it was skipped, not read)", line.number)
    try:
        record = loads_untrusted(line.data)
    except UnreadableJson as error:
        return RowError(line.offset, str(line.offset), RowErrorCode.INVALID_JSON, f"{where}: {error}",
                        line.number)
    if not isinstance(record, dict):
        return RowError(line.offset, str(line.offset), RowErrorCode.INVALID_ROW,
                        f"{where}: a JSON {type(record).__name__} where an object was expected", line.number)
    if _may_escape_a_surrogate(line.data) and not _is_valid_unicode(record):
        # JSON can escape half of a UTF-16 pair ("\ud800"): valid JSON, but no Unicode text, so
        # neither a prompt nor an output line can hold it.
        return RowError(line.offset, str(line.offset), RowErrorCode.INVALID_JSON,
                        f"{where}: a string escapes a lone UTF-16 surrogate (\\ud800-\\udfff), "
                        "which is not valid Unicode text", line.number)
    return record


def _may_escape_a_surrogate(data: bytes) -> bool:
    return b"\\ud" in data or b"\\uD" in data


def _is_valid_unicode(record: dict[str, Any]) -> bool:
    try:
        json.dumps(record, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def iter_jsonl_rows(store: ObjectStore, key: str, start: int, end: int,
                    builder: RowBuilder) -> Iterator[Row | RowError]:
    """Rows (or per-row errors) for the lines starting in `[start, end)`, in file order.

    Blank lines are not rows and are skipped; every other line yields exactly one item.
    """
    for line in iter_lines_in_range(store, key, start, end):
        if not line.data.strip() and not line.too_long:
            continue
        record = decode_object_line(line)
        if isinstance(record, RowError):
            yield record
        else:
            yield builder.build(line.offset, record, line.number)
