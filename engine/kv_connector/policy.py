"""Which prefix blocks the connector saves and loads.

- Saved: blocks that at least `min_hits` requests' prompts share (counted as requests arrive, so a
  job's instruction, in every row, qualifies before its first row runs).
- Loaded: only where the matched prefix is at least `min_tokens` long. Below that, fetching and
  copying cost more than computing, so nothing is fetched.
- Kept: each namespace under a byte budget, least recently used deleted first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping

from bulkinfer.engine.kv_connector.blob_store import KVBlobStore
from bulkinfer.engine.prefix_hash import BlockHash

# Break-even (`bulkinfer bench kvstore --break-even`, docs/engine.md; SmolLM2-135M bf16, 2-core AMX
# Xeon): one row's prefill computed took 29 ms at 16 tokens, 70 ms at 256, 125 ms at 512; loaded from
# a local folder 16-22 ms, so on local disk one block already pays. Over S3 every fetch first waits a
# GET round trip (tens of ms, not measured here), which computing only passes from about 256 tokens;
# and in a batch a short prefix computes in a step that runs anyway, while a fetching row sits out a
# step. So 256: the one figure that pays on both stores.
DEFAULT_MIN_TOKENS = 256
# Distinct prompt blocks whose sharing is counted; older counts are forgotten first.
MAX_COUNTED_BLOCKS = 200_000
# Deleting past the budget goes down to this fraction of it, so the next saves do not each list.
BUDGET_LOW_WATER = 0.9


class ShareCounter:
    """How many requests' prompts held each block hash (bounded, oldest forgotten first)."""

    def __init__(self, max_entries: int = MAX_COUNTED_BLOCKS) -> None:
        self._counts: OrderedDict[BlockHash, int] = OrderedDict()
        self._max_entries = max_entries

    def add_request(self, block_hashes: Iterable[BlockHash]) -> None:
        for block_hash in dict.fromkeys(block_hashes):  # a block repeated in one prompt counts once
            self._counts[block_hash] = self._counts.get(block_hash, 0) + 1
            self._counts.move_to_end(block_hash)
        while len(self._counts) > self._max_entries:
            self._counts.popitem(last=False)

    def count(self, block_hash: BlockHash) -> int:
        return self._counts.get(block_hash, 0)


def delete_past_budget(store: KVBlobStore, namespace: str, budget_bytes: int,
                       recently_used: Mapping[str, float]) -> tuple[int, int]:
    """Delete the namespace's least recently used blocks until it holds at most BUDGET_LOW_WATER of
    `budget_bytes`; `recently_used` (key -> time) adds uses the store does not record (S3 keeps
    only write times). Returns (blocks deleted, bytes left)."""
    entries = sorted(store.list(namespace),
                     key=lambda info: max(info.last_used, recently_used.get(info.key, 0.0)))
    total = sum(info.size for info in entries)
    if total <= budget_bytes:
        return 0, total
    target = int(budget_bytes * BUDGET_LOW_WATER)
    deleted = 0
    for info in entries:
        if total <= target:
            break
        store.delete(info.key)
        total -= info.size
        deleted += 1
    return deleted, total
