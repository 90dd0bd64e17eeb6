import pytest

from bulkinfer.engine.block_pool import NULL_BLOCK_ID, BlockPool, FreeBlockQueue, KVBlock
from bulkinfer.engine.prefix_hash import hash_block_tokens


def _cache(pool: BlockPool, block: KVBlock, tokens: list[int]) -> None:
    assert pool.cache_full_block(block, hash_block_tokens(None, tokens), tokens)


def test_null_block_is_never_handed_out():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(4)
    assert NULL_BLOCK_ID not in [b.block_id for b in blocks]
    assert pool.num_free_blocks == 0 and pool.usage == 1.0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)


def test_free_queue_ops_are_linked_list_operations():
    blocks = [KVBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])  # from the middle, O(1): no scan
    assert [b.block_id for b in queue] == [0, 1, 3, 4] and len(queue) == 4
    assert queue.popleft() is blocks[0]
    queue.append(blocks[2])
    queue.appendleft(blocks[0])
    assert [b.block_id for b in queue] == [0, 1, 3, 4, 2]
    assert blocks[2] in queue and blocks[0].prev_free is not None
    with pytest.raises(ValueError):
        queue.append(blocks[2])  # already queued
    queue.remove(blocks[4])
    with pytest.raises(ValueError):
        queue.remove(blocks[4])


def test_get_new_blocks_pops_from_the_front_in_order():
    pool = BlockPool(6)
    assert [b.block_id for b in pool.get_new_blocks(2)] == [1, 2]
    assert pool.free_queue_ids() == [3, 4, 5]
    assert all(b.ref_cnt == 1 for b in pool.blocks[1:3])


def test_freed_cached_blocks_go_to_the_tail_uncached_to_the_front():
    pool = BlockPool(6)
    a, b, c = pool.get_new_blocks(3)
    _cache(pool, a, [1, 2])
    _cache(pool, b, [3, 4])
    # A request's table freed tail first: c (uncached) is reused first, then b, then a.
    pool.free_blocks(reversed([a, b, c]))
    assert pool.free_queue_ids() == [c.block_id, 4, 5, b.block_id, a.block_id]


def test_lru_eviction_oldest_freed_cached_block_goes_first():
    pool = BlockPool(4)
    old, new, _spare = pool.get_new_blocks(3)
    _cache(pool, old, [1])
    _cache(pool, new, [2])
    pool.free_blocks([old])
    pool.free_blocks([new])
    pool.free_blocks([_spare])  # uncached: handed out first
    assert pool.get_new_blocks(1)[0] is _spare
    evicted = pool.get_new_blocks(1)[0]
    assert evicted is old and evicted.block_hash is None
    assert pool.get_cached_block(hash_block_tokens(None, [1]), [1]) is None
    assert pool.get_cached_block(hash_block_tokens(None, [2]), [2]) is new


def test_touch_takes_a_free_cached_block_out_of_the_free_queue():
    pool = BlockPool(4)
    block = pool.get_new_blocks(1)[0]
    _cache(pool, block, [7, 7])
    pool.free_blocks([block])
    assert block.block_id in pool.free_queue_ids() and block.ref_cnt == 0
    hit = pool.get_cached_block(hash_block_tokens(None, [7, 7]), [7, 7])
    pool.touch([hit])
    assert hit.ref_cnt == 1 and block.block_id not in pool.free_queue_ids()
    # Nothing else can evict it now: all other blocks are handed out, then the pool is empty.
    pool.get_new_blocks(2)
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    assert pool.get_cached_block(hash_block_tokens(None, [7, 7]), [7, 7]) is block


def test_ref_counts_are_shared_across_two_owners():
    pool = BlockPool(3)
    block = pool.get_new_blocks(1)[0]
    _cache(pool, block, [1])
    pool.touch([block])  # a second request hits it
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and pool.num_free_blocks == 2
    with pytest.raises(RuntimeError):
        pool.free_blocks([block])


def test_collision_guard_rejects_a_hash_hit_with_other_tokens():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    forced = hash_block_tokens(None, [0])  # pretend both blocks hash to this
    assert pool.cache_full_block(a, forced, [1, 2])
    assert not pool.cache_full_block(b, forced, [3, 4])  # the hash is taken: b stays uncached
    assert pool.get_cached_block(forced, [3, 4]) is None
    assert pool.get_cached_block(forced, [1, 2]) is a
    parent = hash_block_tokens(None, [5])
    assert pool.get_cached_block(forced, [1, 2], parent) is None  # same tokens, other parent


def test_reset_prefix_cache_refused_while_blocks_are_in_use():
    pool = BlockPool(3)
    block = pool.get_new_blocks(1)[0]
    _cache(pool, block, [1])
    assert not pool.reset_prefix_cache()
    pool.free_blocks([block])
    assert pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 0 and block.block_hash is None


def test_touch_and_free_keep_the_lru_order_on_a_large_pool():
    # 50k hits on cached free blocks spread over the queue, taken out from the middle (an intrusive
    # linked list: O(1) each) and freed back in reverse: the queue is exactly that order after.
    pool = BlockPool(50_001)
    blocks = pool.get_new_blocks(50_000)
    for index, block in enumerate(blocks):
        pool.cache_full_block(block, hash_block_tokens(None, [index]), [index])
    pool.free_blocks(blocks)
    pool.touch(blocks[::2])
    assert pool.num_free_blocks == 25_000 and all(block.ref_cnt == 1 for block in blocks[::2])
    pool.touch(blocks[1::2])
    assert pool.num_free_blocks == 0
    pool.free_blocks(reversed(blocks))
    assert pool.free_queue_ids() == [block.block_id for block in reversed(blocks)]
    assert pool.num_cached_blocks == 50_000  # freed blocks stay cached until evicted
