"""Byte-range line splitting: the rule that gives every line of a file to exactly one shard.

A shard `[start, end)` owns the lines that *start* inside it. It reads from `start - 1`: if that
byte is a newline, the line at `start` is its own; otherwise it skips to the first newline (that
line began in the shard before). It then reads past `end` to finish its last line.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass

from jobs.object_store.base import ObjectStore

READ_CHUNK_BYTES = 1 << 20
UTF8_BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True, slots=True)
class Line:
    offset: int  # byte offset of the line's first byte in the object
    number: int  # 1-based, counted from the shard's first line
    data: bytes  # without the newline (and a trailing \r)


def iter_lines_in_range(store: ObjectStore, key: str, start: int, end: int,
                        chunk_size: int = READ_CHUNK_BYTES) -> Iterator[Line]:
    """The lines that start in `[start, end)`, streamed; blank lines are yielded too."""
    if end <= start:
        return
    read_from = start - 1 if start > 0 else 0
    with closing(store.open_read(key, read_from)) as stream:
        buffer = b""
        position = 0  # index in `buffer` of the next unread byte
        buffer_offset = read_from  # object offset of buffer[0]

        def refill() -> bool:
            nonlocal buffer, position, buffer_offset
            chunk = stream.read(chunk_size)
            if not chunk:
                return False
            buffer_offset += position
            buffer = buffer[position:] + chunk
            position = 0
            return True

        if start > 0:
            while (newline := buffer.find(b"\n", position)) < 0:
                position = len(buffer)
                if not refill():
                    return  # the file ends inside a line that an earlier shard owns
            position = newline + 1

        number = 0
        search_from = position
        while buffer_offset + position < end:
            newline = buffer.find(b"\n", search_from)
            if newline < 0:
                search_from = len(buffer) - position  # relative: refill moves the buffer
                if refill():
                    search_from += position
                    continue
                if position >= len(buffer):
                    return
                newline = len(buffer)  # the last line has no trailing newline
            number += 1
            line_offset = buffer_offset + position
            data = buffer[position:newline]
            if line_offset == 0 and data.startswith(UTF8_BOM):
                data = data[len(UTF8_BOM):]
            yield Line(line_offset, number, data.removesuffix(b"\r"))
            position = newline + 1
            search_from = position
