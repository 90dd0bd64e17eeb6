"""What a step's inputs keep from the last step (vLLM V1's persistent batch): each running request's
block table as a row of one array that lives across steps, written only where it changed, and a
step's plain decode rows gathered as columns instead of one row object each.

A decode step's host work then grows with what changed (a block gained every `block_size`
tokens, a request admitted or preempted), not with every row's whole table: at 256 rows the
tables were rebuilt from lists each step before this.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


class BlockTables:
    """Block tables by request id, one row each of `table` [rows, max_blocks]; entries past a
    table's length are 0 (block 0 is the null block). A request's table list is only ever grown
    in place (kv_cache_manager.py); any other change gives it a new list, so a list that is not
    the one seen last is written whole."""

    def __init__(self, num_rows: int, max_blocks: int) -> None:
        self.table = np.zeros((num_rows, max_blocks), dtype=np.int32)  # block ids fit; half the memory
        self._slot: dict[str, int] = {}
        self._owner: list[str | None] = [None] * num_rows
        self._source: list[Sequence[int] | None] = [None] * num_rows
        self._length = [0] * num_rows
        self._last_used = [0] * num_rows
        self._free = list(range(num_rows - 1, -1, -1))
        self._step = 0

    def rows(self, request_ids: Sequence[str], block_lists: Sequence[Sequence[int]]) -> np.ndarray:
        """Each request's row, its table brought up to date first."""
        self._step += 1
        step = self._step
        slots = np.empty(len(request_ids), dtype=np.int64)
        for i, (request_id, blocks) in enumerate(zip(request_ids, block_lists, strict=True)):
            slot = self._slot.get(request_id)
            if slot is None:
                slot = self._take(request_id)
            length = self._length[slot]
            n = len(blocks)
            if blocks is not self._source[slot] or n < length:
                if n > self.table.shape[1]:
                    raise ValueError(f"request {request_id!r} holds {n} blocks, past the table's "
                                     f"{self.table.shape[1]}")
                self.table[slot, :n] = blocks
                if length > n:
                    self.table[slot, n:length] = 0
                self._source[slot] = blocks
                self._length[slot] = n
            elif n > length:
                self.table[slot, length:n] = blocks[length:]
                self._length[slot] = n
            self._last_used[slot] = step
            slots[i] = slot
        return slots

    def _take(self, request_id: str) -> int:
        """A free row; when none is left, every row not used in this step is freed first (finished
        or waiting requests': a waiting one's row is written again when it runs)."""
        if not self._free:
            for slot, used in enumerate(self._last_used):
                if used < self._step:
                    self._release(slot)
            if not self._free:
                raise ValueError(f"more requests in a step than the {len(self._owner)} block-table rows")
        slot = self._free.pop()
        self._owner[slot] = request_id
        self._slot[request_id] = slot
        return slot

    def _release(self, slot: int) -> None:
        owner = self._owner[slot]
        if owner is None:
            return
        del self._slot[owner]
        self.table[slot, : self._length[slot]] = 0
        self._owner[slot] = None
        self._source[slot] = None
        self._length[slot] = 0
        self._free.append(slot)


@dataclass
class DecodeColumns:
    """A step's plain decode rows (one token each, no adapter, nothing scored) as columns."""

    request_ids: list[str] = field(default_factory=list)
    block_lists: list[Sequence[int]] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)  # each row's position
    token_ids: list[int] = field(default_factory=list)  # 0 for a placeholder
    samples: list[bool] = field(default_factory=list)
    # Computed as if alone (not grouped over shared prefix blocks): a drafted position's column,
    # so verification gets the logits a lone decode gets. None: no such column.
    solo: list[bool] | None = None

    def __len__(self) -> int:
        return len(self.request_ids)

    def add(self, request_id: str, block_ids: Sequence[int], start: int, token_id: int,
            samples: bool, solo: bool = False) -> None:
        if solo and self.solo is None:
            self.solo = [False] * len(self.request_ids)
        if self.solo is not None:
            self.solo.append(solo)
        self.request_ids.append(request_id)
        self.block_lists.append(block_ids)
        self.starts.append(start)
        self.token_ids.append(token_id)
        self.samples.append(samples)
