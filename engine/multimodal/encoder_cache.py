"""Encoder outputs by image digest, least recently used evicted past a budget of rows.

The same image in many rows (one product photo under several questions, a page asked twice) runs the
vision encoder once while its output stays cached. A cache miss is never an error: the runner encodes
the image again (after eviction, or for a recomputed preempted request)."""

from __future__ import annotations

from collections import OrderedDict

import torch


class EncoderCache:
    def __init__(self, capacity_rows: int) -> None:
        self.capacity_rows = capacity_rows
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._rows = 0
        self.hits = 0
        self.misses = 0

    def __contains__(self, digest: str) -> bool:
        return digest in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, digest: str) -> torch.Tensor | None:
        """The cached rows, most recently used from now (None: not cached)."""
        rows = self._entries.get(digest)
        if rows is not None:
            self._entries.move_to_end(digest)
        return rows

    def count(self, hits: int, misses: int) -> None:
        """Images a request needed whose encoder run was saved (hits) or not (misses)."""
        self.hits += hits
        self.misses += misses

    def put(self, digest: str, rows: torch.Tensor) -> None:
        """Keep `rows`, evicting the least recently used entries while over capacity (an entry
        larger than the whole cache is not kept)."""
        if digest in self._entries or len(rows) > self.capacity_rows:
            return
        self._entries[digest] = rows
        self._rows += len(rows)
        while self._rows > self.capacity_rows:
            _, evicted = self._entries.popitem(last=False)
            self._rows -= len(evicted)

    @property
    def hit_rate(self) -> float:
        looked = self.hits + self.misses
        return self.hits / looked if looked else 0.0
