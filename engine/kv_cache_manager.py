"""Per-request block tables on top of the BlockPool: prefix-cache lookup, allocation, caching, free.

Sliding-window layers: where *every* layer attends within a window (Mistral-style, Phi-3 with
``sliding_window``), a block whose tokens are all behind the window of the request's next query is
never read again and goes back to the pool (``sliding_window``, the largest window). Its table
entry becomes the null block, so positions keep their places; attention never reads it (masked,
or skipped by the native decode kernel). Where some layers attend globally (Gemma 3: 5 local to
1 global), those layers need every block and all layers share one block table, so nothing is
freed: per-layer-group tables would save the local layers' share only, at the cost of a second
allocator and prefix cache, and are not built.

Prefix caching stays exact: a block is cached before it leaves a table, and a cached block keeps
its K/V until it is evicted, when its hash goes too. A prefix is found only as an unbroken chain
of cached blocks from the first one, so a request never hits a prefix one of whose blocks is gone,
and a hit gives every layer exactly the K/V it would have computed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from bulkinfer.engine.block_pool import NULL_BLOCK_ID, BlockPool, KVBlock
from bulkinfer.engine.multimodal.block_keys import image_block_keys
from bulkinfer.engine.prefix_hash import BlockHash, extend_block_hashes
from bulkinfer.engine.request import Request, RequestStatus


class KVCacheManager:
    """Owns every request's block table (`request.block_ids` mirrors it for the model runner).

    Blocks are cached once all their tokens are computed (`cache_blocks`, called after each step),
    never at allocation: a block is only ever found by another request after its KV was written.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        hash_extra_keys: Sequence[str] = (),
        sliding_window: int | None = None,
        cache_generated_blocks: bool = True,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        # Set only where every layer slides (see `droppable_window`): blocks behind it are freed.
        self.sliding_window = sliding_window
        self._num_dropped: dict[str, int] = {}  # leading table entries freed behind the window
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # False (batch invariance): only blocks wholly inside the prompt are cached. A generated
        # position's K/V comes from the decode kernel, where a prompt holding that text computes it
        # by prefill when alone: a later prompt hitting such a block would get other bits.
        self.cache_generated_blocks = cache_generated_blocks
        self.block_pool = BlockPool(num_blocks)
        self._hash_extra_keys = tuple(hash_extra_keys)  # e.g. the model id
        self._tables: dict[str, list[KVBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # leading table blocks already in the cache
        self.prefix_cache_queries = 0  # prompt tokens looked up on first admission
        self.prefix_cache_hits = 0  # of those, tokens served from the cache
        # Told of each block that becomes cached and of each prefix hit on first admission (the
        # KV connector saves the shared ones); the block still holds its hash when called.
        self.block_observer: Callable[[KVBlock], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def capacity_tokens(self) -> int:
        """Tokens of KV the whole pool can hold (the null block excluded)."""
        return self.block_pool.num_usable_blocks * self.block_size

    def block_hashes(self, request: Request) -> list[BlockHash]:
        """Hashes of the request's full blocks, hashing only blocks that filled since the last call."""
        if self.enable_prefix_caching:
            extend_block_hashes(
                request.block_hashes, request.all_token_ids, self.block_size, self._extra_keys(request),
                image_block_keys(request.mm_items, self.block_size) if request.mm_items else None,
            )
        return request.block_hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of full blocks and the number of tokens it covers.

        Capped so at least one token is recomputed: the last token's logits are needed to sample;
        and for a request asking for prompt_logprobs, before the first position it has not scored.
        Pure lookup: no references are taken and no stats are counted until `allocate_slots`.
        """
        if not self.enable_prefix_caching:
            return [], 0
        hashes = self.block_hashes(request)
        max_blocks = self.max_hit_blocks(request)
        tokens = request.all_token_ids
        computed: list[KVBlock] = []
        parent: BlockHash | None = None
        for index in range(min(max_blocks, len(hashes))):
            start = index * self.block_size
            block = self.block_pool.get_cached_block(
                hashes[index], tokens[start : start + self.block_size], parent
            )
            if block is None:
                break
            computed.append(block)
            parent = hashes[index]
        return computed, len(computed) * self.block_size

    def max_hit_blocks(self, request: Request) -> int:
        """How many leading blocks may come from a cache (local or the KV store): at least one token
        is computed, for the last token's logits; and for a request asking for prompt_logprobs,
        every position it has not scored yet."""
        max_blocks = (request.num_tokens - 1) // self.block_size
        if request.needs_prompt_logprobs:
            # A cached block has KV but no logits: positions still to be scored are recomputed
            # (their blocks are cached for others as usual once computed).
            max_blocks = min(max_blocks, request.num_prompt_logprobs // self.block_size)
        return max_blocks

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: Sequence[KVBlock] | None = None,
    ) -> list[KVBlock] | None:
        """Grow the request's table to hold its computed tokens plus `num_new_tokens`.

        On admission pass the blocks from `get_computed_blocks` (the request holds no blocks yet);
        the caller then sets `num_computed_tokens` to include them. Returns the newly allocated
        blocks, or None when the pool is short, in which case nothing changed but the release of
        blocks behind every layer's window (never read again).
        """
        table = self._tables.get(request.request_id)
        if (table and not computed_blocks and self.sliding_window is None
                and request.num_computed_tokens + num_new_tokens <= len(table) * self.block_size):
            return []  # the common decode step: its slot is in a block it holds
        computed_blocks = computed_blocks or ()
        if computed_blocks and table:
            raise ValueError(f"request {request.request_id} holds blocks; computed blocks are for admission")
        if table and self.sliding_window is not None:
            self._drop_blocks_behind_window(request, table)
        num_held = len(table) if table else 0
        num_tokens_after = (
            request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        )
        num_needed = -(-num_tokens_after // self.block_size) - num_held - len(computed_blocks)
        # Touching a free cache hit takes it out of the free queue, so it competes for free blocks.
        num_free_hits = sum(1 for block in computed_blocks if block.ref_cnt == 0)
        if max(num_needed, 0) + num_free_hits > self.block_pool.num_free_blocks:
            return None

        if table is None:
            table = self._admit(request, computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_needed) if num_needed > 0 else []
        table.extend(new_blocks)
        request.block_ids.extend(block.block_id for block in new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request) -> None:
        """Add the request's newly full, computed blocks to the prefix cache (prompt or decode)."""
        if not self.enable_prefix_caching:
            return
        table = self._tables.get(request.request_id)
        if table is None:
            return
        # Computed can run ahead of the known tokens by a placeholder (async scheduling): a block
        # is hashed once its tokens are known.
        num_full = min(min(request.num_computed_tokens, request.num_tokens) // self.block_size, len(table))
        if not self.cache_generated_blocks:
            num_full = min(num_full, request.num_prompt_tokens // self.block_size)
        first_uncached = self._num_cached_blocks[request.request_id]
        if num_full <= first_uncached:
            return
        hashes = self.block_hashes(request)
        tokens = request.all_token_ids
        for index in range(first_uncached, num_full):
            start = index * self.block_size
            parent = hashes[index - 1] if index > 0 else None
            added = self.block_pool.cache_full_block(
                table[index], hashes[index], tokens[start : start + self.block_size], parent
            )
            if added and self.block_observer is not None:
                self.block_observer(table[index])
        self._num_cached_blocks[request.request_id] = num_full

    def trim(self, request: Request) -> None:
        """Give back the blocks past the request's known tokens (slots of rejected draft tokens).
        They were never cached: only blocks of computed, accepted tokens are."""
        table = self._tables.get(request.request_id)
        if not table:
            return
        # A step in flight (async scheduling) writes up to num_computed_tokens: its blocks stay.
        num_tokens = max(request.num_tokens, request.num_computed_tokens)
        num_keep = max(-(-num_tokens // self.block_size), self._num_cached_blocks[request.request_id])
        if len(table) <= num_keep:
            return
        surplus = table[num_keep:]
        del table[num_keep:]
        request.block_ids = request.block_ids[:num_keep]  # a new list: only growth keeps the list
        self.block_pool.free_blocks(reversed(surplus))

    def free(self, request: Request) -> None:
        """Release the request's blocks; its full computed blocks are cached first and stay findable."""
        self.cache_blocks(request)
        table = self._tables.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        dropped = self._num_dropped.pop(request.request_id, 0)
        request.block_ids = []  # a new list: a SchedulerOutput already handed out keeps its view
        if table:
            # Tail first: a request's last blocks are the least likely to be shared.
            self.block_pool.free_blocks(reversed(table[dropped:]))

    def num_held_blocks(self, request: Request) -> int:
        """Pool blocks the request holds (its table less the entries freed behind the window)."""
        return len(self._tables.get(request.request_id, ())) - self._num_dropped.get(request.request_id, 0)

    def _drop_blocks_behind_window(self, request: Request, table: list[KVBlock]) -> None:
        """Free the leading blocks no query from here on can see: the next query is at position
        `num_computed_tokens` (n) or later and sees keys after n - window, so a block whose last
        position is at most n - window is never read again."""
        assert self.sliding_window is not None
        rid = request.request_id
        behind = min((request.num_computed_tokens - self.sliding_window + 1) // self.block_size, len(table))
        dropped = self._num_dropped.get(rid, 0)
        if behind <= dropped:
            return
        self.cache_blocks(request)  # cached before it leaves: others may still find it until evicted
        blocks = table[dropped:behind]
        table[dropped:behind] = [self.block_pool.null_block] * (behind - dropped)
        request.block_ids = [NULL_BLOCK_ID] * behind + request.block_ids[behind:]
        self._num_dropped[rid] = behind
        self.block_pool.free_blocks(blocks)

    def reset_prefix_cache(self) -> bool:
        """Drop the whole prefix cache; refused (False) while any request holds blocks."""
        return self.block_pool.reset_prefix_cache()

    def _admit(self, request: Request, computed_blocks: Sequence[KVBlock]) -> list[KVBlock]:
        self._num_dropped.pop(request.request_id, None)
        if self.enable_prefix_caching and request.status is RequestStatus.WAITING:
            # First admission only: a preempted request re-reading its own blocks is not a prompt hit.
            self.prefix_cache_queries += request.num_prompt_tokens
            self.prefix_cache_hits += len(computed_blocks) * self.block_size
            if self.block_observer is not None:
                for block in computed_blocks:
                    self.block_observer(block)
        self.block_pool.touch(computed_blocks)
        table = list(computed_blocks)
        self._tables[request.request_id] = table
        self._num_cached_blocks[request.request_id] = len(computed_blocks)
        request.block_ids = [block.block_id for block in table]
        return table

    def _extra_keys(self, request: Request) -> tuple[str, ...]:
        keys = self._hash_extra_keys
        if request.cache_salt is not None:
            keys = (*keys, "salt:" + request.cache_salt)
        if request.lora_digest is not None:
            # KV computed with an adapter differs from the base model's and another adapter's, and
            # from the same name's before its files were replaced: keyed by the loaded content.
            keys = (*keys, "lora-content:" + request.lora_digest)
        elif request.lora_request is not None:
            # A request built without LLMEngine (no digest): its id and name stand for the content.
            lora = request.lora_request
            keys = (*keys, f"lora:{lora.lora_int_id}:{lora.lora_name}")
        return keys


def droppable_window(*layer_windows: Sequence[int | None]) -> int | None:
    """The window behind which KV blocks may be freed, for models (a target and its draft) whose
    layers have these windows: the largest, where every layer of every model has one, else None."""
    windows = [window for windows in layer_windows for window in windows]
    if not windows or any(window is None for window in windows):
        return None
    return max(windows)  # type: ignore[type-var]
