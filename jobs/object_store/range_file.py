"""A seekable read-only file whose reads are range reads on an object store."""

from __future__ import annotations

import io
from collections.abc import Callable

# (start, end) -> the object's bytes [start, end): one range read (ObjectStore.read_range of one key).
ReadRange = Callable[[int, int], bytes]


class RangeReadFile(io.RawIOBase):
    """Lets pyarrow seek to a Parquet footer and read just the row groups it needs."""

    def __init__(self, read_range: ReadRange, size: int) -> None:
        self._read_range = read_range
        self._size = size
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._size}[whence]
        self._position = max(0, base + offset)
        return self._position

    def size(self) -> int:
        return self._size

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        end = min(self._position + len(buffer), self._size)
        if end <= self._position:
            return 0
        data = self._read_range(self._position, end)
        buffer[: len(data)] = data
        self._position += len(data)
        return len(data)
