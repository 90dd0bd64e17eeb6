"""Counters of the prefix KV store, monotonic (except `stored_bytes`, the namespace's size as last
known), read by the worker's /metrics; updated from the step thread and the I/O threads."""

from __future__ import annotations

import threading

COUNTERS = ("hits_blocks", "misses_blocks", "loaded_bytes", "saved_bytes", "saved_blocks", "load_seconds",
            "failed_loads", "corrupt_blocks", "stored_bytes", "failed_saves")


class KVStoreStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, float] = {name: 0 for name in COUNTERS}

    def add(self, name: str, amount: float = 1) -> None:
        if name not in self._values:
            raise KeyError(f"unknown KV store counter {name!r}")
        with self._lock:
            self._values[name] += amount

    def set(self, name: str, value: float) -> None:
        if name not in self._values:
            raise KeyError(f"unknown KV store counter {name!r}")
        with self._lock:
            self._values[name] = value

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._values)


def empty_stats() -> dict[str, float]:
    """What an engine without a KV store reports: every counter at 0."""
    return KVStoreStats().snapshot()
