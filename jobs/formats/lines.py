"""Byte-range line splitting: the rule that gives every line of a file to exactly one shard.

A shard `[start, end)` owns the lines that *start* inside it. It reads from `start - 1`: if that
byte is a newline, the line at `start` is its own; otherwise it skips to the first newline (that
line began in the shard before). It then reads past `end` to finish its last line.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass

from bulkinfer.jobs.object_store.base import ObjectStore

READ_CHUNK_BYTES = 1 << 20
UTF8_BOM = b"\xef\xbb\xbf"
# A line longer than this is not held in memory: it is skipped to its end and reported by size.
MAX_LINE_BYTES = 32 << 20


@dataclass(frozen=True, slots=True)
class Line:
    offset: int  # byte offset of the line's first byte in the object
    number: int  # 1-based, counted from the shard's first line
    data: bytes  # without the newline (and a trailing \r); empty when the line is too long
    too_long: int = 0  # the line's size in bytes when it was over the limit (its data not read)


def iter_lines_in_range(store: ObjectStore, key: str, start: int, end: int,
                        chunk_size: int = READ_CHUNK_BYTES,
                        max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[Line]:
    """The lines that start in `[start, end)`, streamed; blank lines are yielded too. A line over
    `max_line_bytes` comes back with no data and its size in `too_long`, read past in chunks."""
    if end <= start:
        return
    read_from = start - 1 if start > 0 else 0
    with closing(store.open_read(key, read_from)) as stream:
        buffer = b""
        position = 0  # index in `buffer` of the next unread byte
        buffer_offset = read_from  # object offset of buffer[0]
        search_from = 0  # where the scan for the next newline resumes

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

        def skip_long_line() -> Line:
            """Drop the buffered start of an overlong line and read on to its newline."""
            nonlocal buffer, position, buffer_offset, search_from
            line_offset = buffer_offset + position
            while (newline := buffer.find(b"\n", search_from)) < 0:
                buffer_offset += len(buffer)
                buffer, position, search_from = b"", 0, 0
                if not refill():
                    newline = len(buffer)
                    break
            size = buffer_offset + newline - line_offset
            position = search_from = newline + 1
            return Line(line_offset, number, b"", too_long=size)

        number = 0
        search_from = position
        while buffer_offset + position < end:
            newline = buffer.find(b"\n", search_from)
            if newline < 0:
                if len(buffer) - position > max_line_bytes:
                    number += 1
                    yield skip_long_line()
                    continue
                search_from = len(buffer) - position  # relative: refill moves the buffer
                if refill():
                    search_from += position
                    continue
                if position >= len(buffer):
                    return
                newline = len(buffer)  # the last line has no trailing newline
            number += 1
            line_offset = buffer_offset + position
            if newline - position > max_line_bytes:  # the whole line came in one read
                yield Line(line_offset, number, b"", too_long=newline - position)
                position = search_from = newline + 1
                continue
            data = buffer[position:newline]
            if line_offset == 0 and data.startswith(UTF8_BOM):
                data = data[len(UTF8_BOM):]
            yield Line(line_offset, number, data.removesuffix(b"\r"))
            position = newline + 1
            search_from = position
