import pytest

import bulkinfer.engine.prefix_hash as prefix_hash
from bulkinfer.engine.kv_cache_manager import KVCacheManager, droppable_window
from bulkinfer.engine.request import Request, RequestStatus
from bulkinfer.engine.sampling_params import SamplingParams

BLOCK = 4


def _request(request_id: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(request_id, tokens, SamplingParams(), cache_salt=salt)


def _compute(manager: KVCacheManager, request: Request, num_new: int, computed=None) -> None:
    """Allocate like the scheduler does, then pretend the forward pass ran."""
    blocks, num_computed = computed if computed is not None else ([], 0)
    assert manager.allocate_slots(request, num_new, blocks) is not None
    request.num_computed_tokens = num_computed + request.num_computed_tokens + num_new
    request.status = RequestStatus.RUNNING
    manager.cache_blocks(request)


def _admit(manager: KVCacheManager, request: Request) -> int:
    """Admit with a prefix-cache lookup and compute the whole rest of the prompt; returns hits."""
    blocks, num_computed = manager.get_computed_blocks(request)
    _compute(manager, request, request.num_tokens - num_computed, (blocks, num_computed))
    return num_computed


def test_second_request_hits_the_shared_prefix_and_shares_blocks():
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK)
    first = _request("a", list(range(10)))
    second = _request("b", list(range(8)) + [99, 98, 97])
    assert _admit(manager, first) == 0
    assert _admit(manager, second) == 8
    assert first.block_ids[:2] == second.block_ids[:2]
    assert first.block_ids[2] != second.block_ids[2]
    shared = manager.block_pool.blocks[first.block_ids[0]]
    assert shared.ref_cnt == 2
    assert manager.prefix_cache_queries == 21 and manager.prefix_cache_hits == 8
    assert second.num_computed_tokens == 11


def test_fully_cached_prompt_still_recomputes_at_least_one_token():
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK)
    _admit(manager, _request("a", list(range(8))))
    again = _request("b", list(range(8)))
    blocks, num_computed = manager.get_computed_blocks(again)
    # 8 tokens = 2 full cached blocks, but the cap is (8 - 1) // 4 = 1 block.
    assert num_computed == 4 and len(blocks) == 1


def test_cache_salt_and_extra_keys_separate_caches():
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK, hash_extra_keys=("model-a",))
    _admit(manager, _request("a", list(range(9)), salt="tenant-1"))
    assert manager.get_computed_blocks(_request("b", list(range(9)), salt="tenant-2"))[1] == 0
    assert manager.get_computed_blocks(_request("c", list(range(9)), salt="tenant-1"))[1] == 8
    other_model = KVCacheManager(num_blocks=16, block_size=BLOCK, hash_extra_keys=("model-b",))
    salted = _request("d", list(range(9)), salt="tenant-1")
    other_model.block_hashes(salted)
    assert salted.block_hashes[0] != manager.block_hashes(_request("e", list(range(9)), "tenant-1"))[0]


def test_decode_filled_blocks_are_cached_and_hit_after_preemption():
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK)
    request = _request("a", [1, 2, 3])
    _compute(manager, request, 3)
    for token in [4, 5, 6, 7, 8]:  # decode: sample a token, then compute it next step
        request.all_token_ids.append(token)
        request.output_token_ids.append(token)
        _compute(manager, request, 1)
    assert request.num_computed_tokens == 8
    manager.free(request)  # preempted: recompute from scratch
    request.num_computed_tokens = 0
    request.status = RequestStatus.PREEMPTED
    blocks, num_computed = manager.get_computed_blocks(request)
    assert num_computed == 4  # 8 known tokens, cap (8 - 1) // 4 = 1 block: the decode-filled block
    request.all_token_ids.append(9)
    assert manager.get_computed_blocks(request)[1] == 8
    queries_before = manager.prefix_cache_queries
    _compute(manager, request, 1, manager.get_computed_blocks(request))
    assert manager.prefix_cache_queries == queries_before  # a recompute is not a new prompt query


def test_allocate_returns_none_and_changes_nothing_when_short():
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK)  # 3 usable blocks
    big = _request("a", list(range(13)))
    assert manager.allocate_slots(big, 13) is None
    assert manager.num_free_blocks == 3 and big.block_ids == []
    small = _request("b", list(range(12)))
    new_blocks = manager.allocate_slots(small, 12)
    assert [b.block_id for b in new_blocks] == small.block_ids and len(small.block_ids) == 3
    assert manager.usage == 1.0


def test_free_cache_hits_count_against_free_blocks():
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK)  # 3 usable
    first = _request("a", list(range(8)))
    _admit(manager, first)
    manager.free(first)  # both full blocks stay cached, in the free queue
    too_big = _request("b", list(range(8)) + [50, 51, 52, 53, 54])
    blocks, num_computed = manager.get_computed_blocks(too_big)
    assert num_computed == 8 and all(block.ref_cnt == 0 for block in blocks)
    # 2 free hits + 2 new blocks > 3 free blocks, although only 2 new blocks are "needed".
    assert manager.allocate_slots(too_big, 5, blocks) is None
    assert manager.num_free_blocks == 3 and all(block.ref_cnt == 0 for block in blocks)
    fits = _request("c", list(range(8)) + [50])
    blocks, _ = manager.get_computed_blocks(fits)
    assert manager.allocate_slots(fits, 1, blocks) is not None
    assert manager.num_free_blocks == 0 and fits.block_ids[:2] == [block.block_id for block in blocks]


def test_free_releases_tail_first_and_keeps_full_blocks_cached():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK)
    request = _request("a", list(range(10)))
    _admit(manager, request)
    table = list(request.block_ids)
    manager.free(request)
    assert request.block_ids == [] and manager.num_free_blocks == 7
    order = manager.block_pool.free_queue_ids()
    assert order[0] == table[2]  # the partial block holds nothing cacheable: reused first
    assert order[-2:] == [table[1], table[0]]  # the prefix is evicted last
    assert manager.get_computed_blocks(_request("b", list(range(10))))[1] == 8


def test_collision_guard_with_a_forced_hash(monkeypatch):
    def constant_hash(parent, token_ids, extra_keys=()):
        return prefix_hash.BlockHash(b"\x01" * 32)

    monkeypatch.setattr(prefix_hash, "hash_block_tokens", constant_hash)
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK)
    _admit(manager, _request("a", [1, 1, 1, 1, 2, 2, 2, 2, 0]))
    other = _request("b", [3, 3, 3, 3, 4, 4, 4, 4, 0])
    assert other.block_hashes == [] and manager.block_hashes(other)[0] == b"\x01" * 32
    assert manager.get_computed_blocks(other) == ([], 0)  # same hash, other tokens: a miss
    # Within one request, block 1 collides with block 0 and must not be served by it.
    repeat = _request("c", [1, 1, 1, 1, 3, 3, 3, 3, 0])
    blocks, num_computed = manager.get_computed_blocks(repeat)
    assert num_computed == 4


def test_prefix_caching_disabled_never_hits():
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK, enable_prefix_caching=False)
    _admit(manager, _request("a", list(range(9))))
    assert manager.get_computed_blocks(_request("b", list(range(9)))) == ([], 0)
    assert manager.block_pool.num_cached_blocks == 0 and manager.prefix_cache_queries == 0


def test_reset_prefix_cache():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK)
    request = _request("a", list(range(9)))
    _admit(manager, request)
    assert not manager.reset_prefix_cache()
    manager.free(request)
    assert manager.reset_prefix_cache()
    assert manager.get_computed_blocks(_request("b", list(range(9))))[1] == 0


def test_computed_blocks_only_on_admission():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK)
    _admit(manager, _request("a", list(range(9))))
    request = _request("b", list(range(9)))
    blocks, _ = manager.get_computed_blocks(request)
    _compute(manager, request, 1, (blocks, 8))
    with pytest.raises(ValueError):
        manager.allocate_slots(request, 1, blocks)


# ---- sliding windows -----------------------------------------------------------------------------


def _decode(manager: KVCacheManager, request: Request) -> None:
    request.append_output_token(7, 0.0)
    _compute(manager, request, 1)


def test_blocks_behind_every_layers_window_go_back_to_the_pool():
    # Window 6, blocks of 4: a query at position q sees keys after q - 6 (transformers' rule), and
    # the next query is at n = num_computed_tokens, so block i (positions 4i..4i+3) is never read
    # again once 4i + 3 <= n - 6.
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK, sliding_window=6)
    request = _request("a", list(range(13)))
    _compute(manager, request, 13)
    assert manager.num_held_blocks(request) == 4
    free_before = manager.num_free_blocks
    _decode(manager, request)  # allocated at n = 13: keys from 8 on, blocks 0 and 1 are behind
    assert request.block_ids[:2] == [0, 0] and 0 not in request.block_ids[2:]
    assert len(request.block_ids) == 4 and manager.num_held_blocks(request) == 2
    assert manager.num_free_blocks == free_before + 2
    for _ in range(3):  # n = 14, 15, 16: keys from 9, 10, 11 on: block 2 (8-11) still read
        _decode(manager, request)
        assert request.block_ids[2] != 0
    _decode(manager, request)  # n = 17: keys from 12 on
    assert request.block_ids[:3] == [0, 0, 0] and manager.num_held_blocks(request) == 2
    manager.free(request)  # the dropped entries are not freed twice
    assert manager.num_free_blocks == 15


def test_without_a_window_on_every_layer_nothing_is_freed():
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK)  # droppable_window gave None
    request = _request("a", list(range(30)))
    _compute(manager, request, 30)
    _decode(manager, request)
    assert 0 not in request.block_ids and manager.num_held_blocks(request) == 8


def test_a_dropped_block_stays_findable_until_evicted_and_a_broken_chain_is_not_hit():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK, sliding_window=4)
    first = _request("a", list(range(17)))
    _compute(manager, first, 16)
    _compute(manager, first, 1)  # n = 16: blocks 0-2 (positions <= 12) dropped, cached first
    assert first.block_ids[:3] == [0, 0, 0]
    # Their K/V is intact until reused: another request with the same prompt hits all of them.
    twin = _request("b", list(range(17)))
    assert manager.get_computed_blocks(twin)[1] == 16
    # Take every free block (evicting the dropped ones), then the same prompt finds nothing.
    hog = _request("c", [1000 + i for i in range(4 * manager.num_free_blocks)])
    _compute(manager, hog, hog.num_tokens)
    assert manager.get_computed_blocks(_request("d", list(range(17))))[1] == 0


def test_droppable_window_needs_every_layer_of_every_model_to_slide():
    assert droppable_window((8, 8, 8)) == 8
    assert droppable_window((8, 16)) == 16
    assert droppable_window((8, None, 8, None)) is None  # Gemma 3: global layers need every block
    assert droppable_window((8, 8), (None,)) is None  # a full-attention draft reads the same tables
    assert droppable_window((None,)) is None and droppable_window(()) is None
