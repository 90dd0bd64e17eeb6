"""CSV records by byte range: where each row starts, when a quoted field may hold a newline.

A record is what pyarrow's CSV parser reads as one row (quote `"`, doubled to escape it, newlines
allowed in values): fields split by the delimiter; a field that starts with a quote runs to the
quote that closes it (a quote anywhere else is a plain character); a record ends at `\\r\\n`, `\\n` or
`\\r` outside quotes. One regular expression with possessive quantifiers follows exactly those
states, so the planner (a cut every `shard_size` records) and each shard's reader (the records that
start in its range) agree on every row start, and a shard never reads a byte before its range.
Empty lines are no records, as pyarrow skips them too.

A quote opened and not closed (before the end of the file, or within `MAX_RECORD_BYTES`) makes a
`malformed` record of its physical line: that row's error; the lines after it are read as usual.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Generator, Iterable, Iterator
from contextlib import closing
from dataclasses import dataclass, field
from functools import cache
from typing import BinaryIO

from bulkinfer.jobs.formats.lines import READ_CHUNK_BYTES, UTF8_BOM
from bulkinfer.jobs.object_store.base import ObjectStore

# A record longer than this (a runaway quote, mostly) is not held: it becomes a malformed record.
MAX_RECORD_BYTES = 32 << 20
# Records the planner counts in one match (when no cut falls among them): C speed, not Python's.
BULK_RECORDS = 64
# What pyarrow parses in one call (`blocks`).
BLOCK_ROWS = 1024
BLOCK_BYTES = 8 << 20
_LINE_END = re.compile(rb"\r\n|\n|\r")


@dataclass(frozen=True, slots=True)
class Record:
    offset: int  # byte offset of the record's first byte in the object
    data: bytes  # the record with its line end (the file's last one may have none)
    malformed: str = ""  # why pyarrow cannot read it as a row (then `data` is its first line, or empty)


def _record(delimiter: bytes) -> bytes:
    d = re.escape(delimiter)
    quoted = rb'"[^"]*+(?:""[^"]*+)*+"[^' + d + rb"\r\n]*+"  # after the closing quote: plain text
    plain = rb'[^"' + d + rb"\r\n][^" + d + rb"\r\n]*+"
    one_field = rb"(?:" + quoted + rb"|" + plain + rb")?+"
    return one_field + rb"(?:" + d + one_field + rb")*+(?>\r\n|\n|\r)"


@cache
def record_pattern(delimiter: bytes) -> re.Pattern[bytes]:
    """One whole record, line end included, by pyarrow's quoting rules (an empty line is one too)."""
    return re.compile(_record(delimiter))


@cache
def bulk_pattern(delimiter: bytes) -> re.Pattern[bytes]:
    """`BULK_RECORDS` non-empty records, with the empty lines before each (atomic: no backtracking)."""
    return re.compile(rb"(?>[\r\n]*+" + _record(delimiter) + rb"){%d}" % BULK_RECORDS)


def header_offset(store: ObjectStore, key: str, skip_bom: bool) -> int:
    """Where the header record starts: after a UTF-8 byte-order mark (when the text is UTF-8)."""
    return len(UTF8_BOM) if skip_bom and store.read_range(key, 0, len(UTF8_BOM)) == UTF8_BOM else 0


def iter_records(store: ObjectStore, key: str, start: int, end: int, delimiter: bytes,
                 chunk_size: int = READ_CHUNK_BYTES,
                 max_record_bytes: int = MAX_RECORD_BYTES) -> Generator[Record, None, None]:
    """The non-empty records starting in `[start, end)`, in order; `start` must be a record start
    (0, the header's end, or a cut the planner made)."""
    if end <= start:
        return
    with closing(store.open_read(key, start)) as stream:
        yield from stream_records(stream, delimiter, start, end, chunk_size, max_record_bytes)


def stream_records(stream: BinaryIO, delimiter: bytes, start: int = 0, end: int = sys.maxsize,
                   chunk_size: int = READ_CHUNK_BYTES,
                   max_record_bytes: int = MAX_RECORD_BYTES) -> Iterator[Record]:
    """`iter_records` over a stream that begins at offset `start` of its file (a part read back)."""
    pattern = record_pattern(delimiter)
    buffer = _Buffer(stream, start, chunk_size)
    while buffer.offset < end:
        record = buffer.next_record(pattern, max_record_bytes)
        if record is None:
            return
        if record.malformed or record.data.strip(b"\r\n"):
            yield record


def blocks(records: Iterable[Record], max_rows: int = BLOCK_ROWS,
           max_bytes: int = BLOCK_BYTES) -> Iterator[list[Record]]:
    """Records in lists of at most `max_rows`, cut early once a list holds `max_bytes`."""
    block: list[Record] = []
    size = 0
    for record in records:
        block.append(record)
        size += len(record.data)
        if len(block) == max_rows or size >= max_bytes:
            yield block
            block, size = [], 0
    if block:
        yield block


@dataclass
class RecordCounts:
    """`cuts`: the byte offset where each shard starts (the first at the data's start); `rows`."""

    shard_size: int
    cuts: list[int] = field(default_factory=list)
    rows: int = 0

    def shard_rows(self) -> list[int]:
        return [min(self.shard_size, self.rows - index * self.shard_size) for index in range(len(self.cuts))]


def count_records(store: ObjectStore, key: str, start: int, end: int, delimiter: bytes, shard_size: int,
                  chunk_size: int = READ_CHUNK_BYTES,
                  max_record_bytes: int = MAX_RECORD_BYTES) -> RecordCounts:
    """One streaming pass: the rows from `start` on, and a cut before every `shard_size`-th."""
    counts = RecordCounts(shard_size, [start])
    if end <= start:
        return counts
    single, bulk = record_pattern(delimiter), bulk_pattern(delimiter)
    with closing(store.open_read(key, start)) as stream:
        buffer = _Buffer(stream, start, chunk_size)
        while buffer.offset < end:
            at_cut = counts.rows > 0 and counts.rows % shard_size == 0  # its next record starts a shard
            if not at_cut and shard_size - counts.rows % shard_size >= BULK_RECORDS and buffer.skip(bulk):
                counts.rows += BULK_RECORDS
                continue
            record = buffer.next_record(single, max_record_bytes)
            if record is None:
                break
            if record.malformed or record.data.strip(b"\r\n"):
                if counts.rows and counts.rows % shard_size == 0:
                    counts.cuts.append(record.offset)
                counts.rows += 1
    return counts


class _Buffer:
    """The stream from a record start, read a chunk at a time, cut into records."""

    def __init__(self, stream: BinaryIO, offset: int, chunk_size: int) -> None:
        self.stream = stream
        self.chunk_size = chunk_size
        self.data = b""
        self.position = 0  # in `data`, of the next record
        self.base = offset  # object offset of data[0]
        self.at_end = False

    @property
    def offset(self) -> int:
        return self.base + self.position

    def next_record(self, pattern: re.Pattern[bytes], limit: int) -> Record | None:
        while True:
            match = pattern.match(self.data, self.position)
            if match is not None:
                return self._take(match.end())
            pending = len(self.data) - self.position
            if pending <= limit and self._read_more():
                continue  # the record may go on in the next chunk
            if pending == 0:
                return None
            if self.at_end:
                return self._last(pattern)
            return self._overlong(limit)

    def skip(self, pattern: re.Pattern[bytes]) -> bool:
        """Step over what `pattern` matches whole in the buffer; False (nothing moved) if it does not."""
        match = pattern.match(self.data, self.position)
        if match is None:
            return False
        self.position = match.end()
        return True

    def _read_more(self) -> bool:
        chunk = b"" if self.at_end else self.stream.read(self.chunk_size)
        if not chunk:
            self.at_end = True
            return False
        self.data = self.data[self.position:] + chunk
        self.base += self.position
        self.position = 0
        return True

    def _take(self, stop: int, malformed: str = "") -> Record:
        record = Record(self.offset, self.data[self.position:stop], malformed)
        self.position = stop
        return record

    def _last(self, pattern: re.Pattern[bytes]) -> Record:
        """The file's last record, which has no line end; or an unclosed quote's line."""
        match = pattern.match(self.data + b"\n", self.position)
        if match is not None and match.end() == len(self.data) + 1:
            return self._take(len(self.data))
        return self._first_line("a quoted field is not closed before the end of the file")

    def _overlong(self, limit: int) -> Record:
        if _LINE_END.search(self.data, self.position) is not None:
            return self._first_line(f"a quoted field is not closed within {_size(limit)}")
        offset, size = self.offset, 0  # one line over the limit: read past its end, holding none of it
        while (line_end := _LINE_END.search(self.data, self.position)) is None:
            size += len(self.data) - self.position
            self.base += len(self.data)
            self.data, self.position = b"", 0
            if not self._read_more():
                return _overlong_record(offset, size, limit)
        size += line_end.end() - self.position
        self.position = line_end.end()
        return _overlong_record(offset, size, limit)

    def _first_line(self, why: str) -> Record:
        line_end = _LINE_END.search(self.data, self.position)
        return self._take(line_end.end() if line_end else len(self.data), malformed=why)


def _overlong_record(offset: int, size: int, limit: int) -> Record:
    return Record(offset, b"", f"the row is {size:,} bytes, over the {_size(limit)} a row may have (it was "
                               "skipped, not read)")


def _size(limit: int) -> str:
    return f"{limit >> 20} MiB" if limit >= 1 << 20 else f"{limit:,} bytes"
