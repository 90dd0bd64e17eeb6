"""The blocks of one flush of saves, written by several I/O threads at once."""

from __future__ import annotations

import threading


class SaveBatch:
    """Counts a flush's blocks as their writes end; the last to end gets every block that is now in
    the store (written, or already there) with its chain rank, so the flush's uses are recorded
    after the last write, in chain order, whichever thread finished first."""

    def __init__(self, size: int) -> None:
        self._left = size
        self._stored: list[tuple[str, int]] = []
        self._lock = threading.Lock()

    def finish(self, key: str | None, depth_rank: int) -> list[tuple[str, int]] | None:
        """One block's write ended (`key` None: it failed). Returns the flush's (key, rank) pairs
        to the call that ends the flush, None to the others."""
        with self._lock:
            if key is not None:
                self._stored.append((key, depth_rank))
            self._left -= 1
            return list(self._stored) if self._left == 0 else None
