"""Exact JSONL row counts in one streaming pass: the shard cuts, and every limit that counts rows.

A row is a line that is not blank, as the readers see it (`formats.jsonl`, `formats.lines`): lines
end at `\\n`, a line of only ASCII whitespace is no row, and a UTF-8 BOM before the first line is not
content. The pass reads the object in chunks and holds none of it: most chunks are counted with C
loops (`bytes.count`, a regex for blank lines); only a chunk in which a shard must start is walked
row by row (a regex finds each row's start) to find where. A line longer than a chunk costs nothing
more than its bytes.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass, field

from bulkinfer.jobs.formats.lines import READ_CHUNK_BYTES, UTF8_BOM
from bulkinfer.jobs.object_store.base import ObjectStore

_CONTENT = re.compile(rb"[^ \t\r\n\x0b\x0c]")  # bytes.strip()'s whitespace is everything else
_BLANK_LINE_AFTER_NEWLINE = re.compile(rb"\n[ \t\r\x0b\x0c]*(?=\n)")
_ROW_AFTER_NEWLINE = re.compile(rb"\n[ \t\r\x0b\x0c]*[^ \t\r\n\x0b\x0c]")  # a newline, then a row


@dataclass
class RowStarts:
    """`cuts`: the byte offset where each shard starts (the first at 0); `rows`: rows in the file."""

    shard_size: int
    cuts: list[int] = field(default_factory=lambda: [0])
    rows: int = 0

    def shard_rows(self) -> list[int]:
        """How many rows each shard holds."""
        return [min(self.shard_size, self.rows - index * self.shard_size) for index in range(len(self.cuts))]


def count_row_starts(store: ObjectStore, key: str, shard_size: int,
                     chunk_size: int = READ_CHUNK_BYTES) -> RowStarts:
    """Where each shard of `shard_size` rows starts in the JSONL object, and how many rows it has."""
    counter = _Counter(RowStarts(shard_size))
    base = 0
    for chunk in _chunks(store, key, chunk_size):
        counter.add(chunk, base)
        base += len(chunk)
    counter.finish()
    return counter.result


class _Counter:
    def __init__(self, result: RowStarts) -> None:
        self.result = result
        self.line_start = 0  # offset of the line being read (it has no newline yet)
        self.line_has_content = False

    def add(self, chunk: bytes, base: int) -> None:
        first = chunk.find(b"\n")
        if first < 0:
            self.line_has_content = self.line_has_content or _CONTENT.search(chunk) is not None
            return
        last = chunk.rfind(b"\n")
        rows = int(self.line_has_content or _CONTENT.search(chunk, 0, first) is not None)
        inner_lines = chunk.count(b"\n", first + 1, last + 1)  # lines that start and end in the chunk
        rows += inner_lines - len(_BLANK_LINE_AFTER_NEWLINE.findall(chunk, first, last + 1))
        if self._cut_among(rows):
            self._walk(chunk, base, first, last)
            return
        self.result.rows += rows
        self.line_start = base + last + 1
        self.line_has_content = _CONTENT.search(chunk, last + 1) is not None

    def finish(self) -> None:
        if self.line_has_content:  # the last line has no newline
            self._row(self.line_start)

    def _cut_among(self, rows: int) -> bool:
        """Whether one of the next `rows` rows starts a shard (a row numbered a multiple of shard_size)."""
        size, counted = self.result.shard_size, self.result.rows
        next_cut = max(size, -(-counted // size) * size)
        return rows > 0 and next_cut <= counted + rows - 1

    def _walk(self, chunk: bytes, base: int, first: int, last: int) -> None:
        """Every row ending in the chunk, one by one (at C speed: a regex finds each row's start)."""
        if self.line_has_content or _CONTENT.search(chunk, 0, first) is not None:
            self._row(self.line_start)
        for match in _ROW_AFTER_NEWLINE.finditer(chunk, first, last):
            self._row(base + match.start() + 1)
        self.line_start = base + last + 1
        self.line_has_content = _CONTENT.search(chunk, last + 1) is not None

    def _row(self, start: int) -> None:
        result = self.result
        if result.rows and result.rows % result.shard_size == 0:
            result.cuts.append(start)
        result.rows += 1


def _chunks(store: ObjectStore, key: str, chunk_size: int) -> Iterator[bytes]:
    """The object in chunks, a leading BOM turned into spaces (offsets stay; it is no content)."""
    with closing(store.open_read(key, 0)) as stream:
        head = b""
        while len(head) < len(UTF8_BOM) and (chunk := stream.read(chunk_size)):
            head += chunk
        if head.startswith(UTF8_BOM):
            head = b" " * len(UTF8_BOM) + head[len(UTF8_BOM):]
        if head:
            yield head
        while chunk := stream.read(chunk_size):
            yield chunk
