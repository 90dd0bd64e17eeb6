"""KV blocks, the free-block queue and the prefix-cache map from block hash to block.

Block 0 is reserved as the *null block*: it is never handed out, so it never appears in a block
table and the model runner may point padding slots at it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from bulkinfer.engine.prefix_hash import BlockHash

NULL_BLOCK_ID = 0


class KVBlock:
    """One block of `block_size` KV slots.

    While cached, `block_hash`, `parent_hash` and `token_ids` describe exactly what the hash covered,
    so a lookup can reject a hash collision. `prev_free`/`next_free` link it into the free queue.
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "parent_hash", "token_ids", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.parent_hash: BlockHash | None = None
        self.token_ids: tuple[int, ...] | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def clear_hash(self) -> None:
        self.block_hash = None
        self.parent_hash = None
        self.token_ids = None

    def __repr__(self) -> str:
        cached = "cached" if self.block_hash is not None else "uncached"
        return f"KVBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, {cached})"


class FreeBlockQueue:
    """Doubly linked list of free blocks between two sentinels: every operation is O(1).

    The front is handed out (and evicted) first.
    """

    def __init__(self, blocks: Iterable[KVBlock] = ()) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._length = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._length

    def __iter__(self) -> Iterator[KVBlock]:
        node = self._head.next_free
        while node is not self._tail:
            assert node is not None
            yield node
            node = node.next_free

    def __contains__(self, block: KVBlock) -> bool:
        return block.prev_free is not None

    def popleft(self) -> KVBlock:
        if self._length == 0:
            raise IndexError("pop from an empty free-block queue")
        block = self._head.next_free
        assert block is not None
        self.remove(block)
        return block

    def append(self, block: KVBlock) -> None:
        self._insert_after(self._tail.prev_free, block)

    def appendleft(self, block: KVBlock) -> None:
        self._insert_after(self._head, block)

    def remove(self, block: KVBlock) -> None:
        prev_block, next_block = block.prev_free, block.next_free
        if prev_block is None or next_block is None:
            raise ValueError(f"{block} is not in the free queue")
        prev_block.next_free = next_block
        next_block.prev_free = prev_block
        block.prev_free = block.next_free = None
        self._length -= 1

    def _insert_after(self, anchor: KVBlock | None, block: KVBlock) -> None:
        if block.prev_free is not None:
            raise ValueError(f"{block} is already in the free queue")
        assert anchor is not None and anchor.next_free is not None
        block.prev_free = anchor
        block.next_free = anchor.next_free
        anchor.next_free.prev_free = block
        anchor.next_free = block
        self._length += 1


class BlockPool:
    """All KV blocks: ref counts, the free queue and the prefix-cache hash map.

    A freed block keeps its hash and stays findable until it is handed out again; freed cached
    blocks go to the tail of the free queue, so the least recently used is evicted first. Freed
    blocks without a hash go to the front: they hold nothing worth keeping.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        self.blocks = [KVBlock(block_id) for block_id in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.null_block.ref_cnt = 1  # never freed, never handed out
        self._free_queue = FreeBlockQueue(self.blocks[NULL_BLOCK_ID + 1 :])
        self._cached: dict[BlockHash, KVBlock] = {}

    @property
    def num_usable_blocks(self) -> int:
        return len(self.blocks) - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no owner, cached or not: all of them can be handed out."""
        return len(self._free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def free_queue_ids(self) -> list[int]:
        """Block ids in eviction order (front first); for tests and debugging, O(n)."""
        return [block.block_id for block in self._free_queue]

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Hand out `num_blocks` from the front of the free queue, evicting any cached content."""
        if num_blocks > len(self._free_queue):
            raise ValueError(f"asked for {num_blocks} blocks, only {len(self._free_queue)} free")
        new_blocks = []
        for _ in range(num_blocks):
            block = self._free_queue.popleft()
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference to cache hits; a hit on a free block takes it out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self._free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 are queued in the order given.

        Callers pass a request's table reversed, so its tail blocks are evicted before its prefix.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self._free_queue.appendleft(block)
                else:
                    self._free_queue.append(block)

    def cache_full_block(
        self,
        block: KVBlock,
        block_hash: BlockHash,
        token_ids: Sequence[int],
        parent_hash: BlockHash | None = None,
    ) -> bool:
        """Make a full, computed block findable by its hash. Returns whether it was added.

        A block that is already cached keeps its entry; if another block already holds this hash,
        the new one stays uncached (a duplicate computed concurrently) and is reused first when freed.
        """
        if block.block_hash is not None or block_hash in self._cached:
            return False
        block.block_hash = block_hash
        block.parent_hash = parent_hash
        block.token_ids = tuple(token_ids)
        self._cached[block_hash] = block
        return True

    def get_cached_block(
        self,
        block_hash: BlockHash,
        token_ids: Sequence[int],
        parent_hash: BlockHash | None = None,
    ) -> KVBlock | None:
        """The cached block for this hash, or None. A hit whose stored parent or tokens differ
        from the ones asked for is a hash collision and counts as a miss."""
        block = self._cached.get(block_hash)
        if block is None or block.parent_hash != parent_hash or block.token_ids != tuple(token_ids):
            return None
        return block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block. Refused (False) while any block is in use."""
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        for block in self._cached.values():
            block.clear_hash()
        self._cached.clear()
        return True

    def _evict(self, block: KVBlock) -> None:
        assert block.block_hash is not None
        if self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
        block.clear_hash()
