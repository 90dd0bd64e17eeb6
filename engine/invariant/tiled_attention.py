"""Paged attention whose every call has fixed shapes, so a query's bits never follow the step.

SDPA's kernels block keys and queries by the call's lengths: a chunked prefill (context and own part
merged by log-sum-exp), a prefix from the cache, or decode keys padded to the step's longest row each
round a query differently. Here each query reads its sequence's keys in tiles of ``KEY_TILE`` keys
starting at key 0 (the last one masked past its length), one tile after another, merged by an online
softmax in fp32. A tile a query sees nothing of leaves its state exactly as it was, so a row beside
longer rows (more tiles in the call) gets the bits it gets alone. Every matmul and reduction has one
shape: prefill queries in blocks of ``QUERY_BLOCK`` tokens, decode rows in blocks of
``DECODE_BLOCK_ROWS`` rows, padding dropped at the end.

Prefill and decode queries have different shapes (a block of a chunk's tokens over shared tiles;
rows each over their own), so the same position may round differently through the two: the engine
sends prompt positions through prefill and generated ones through decode rows in every schedule
(``invariant_rows`` in engine/model_runner.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bulkinfer.engine.cache_rows import gather_cache_rows, head_major_rows

KEY_TILE = 256  # keys per tile: 16 KV blocks of 16 tokens
QUERY_BLOCK = 64  # a prefill chunk's query tokens per call
# Decode rows per call. Fewer than the projections' blocks: each padding row costs its tiles' products
# (a projection's padding rows cost little while the GEMM streams its weights), and on the CPU a
# step of 8 rows in blocks of 64 spent 3x its time in attention (bench suite, kernels off).
DECODE_BLOCK_ROWS = 16
# Decode tiles gathered per copy: fewer, larger copies, and a bounded buffer on long contexts.
TILES_PER_GATHER = 4


def _gather_tile(cache: torch.Tensor, block_ids: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``block_ids [..., blocks]`` of ``cache [blocks, kv_heads, block_size, dim]`` as one
    contiguous tensor of ``shape`` (an fp32 copy: the tile's products and sums are fp32)."""
    return gather_cache_rows(cache, head_major_rows(block_ids, cache.shape[-3]).reshape(-1), shape).float()


def _blocks_per_tile(cache: torch.Tensor) -> int:
    block_size = cache.shape[-2]
    if KEY_TILE % block_size:
        raise ValueError(f"KV block size {block_size} does not divide the key tile ({KEY_TILE})")
    return KEY_TILE // block_size


def _padded_table(table: torch.Tensor, num_tiles: int, blocks_per_tile: int) -> torch.Tensor:
    """``table [..., n]`` cut or padded with block 0 (masked) to ``num_tiles`` whole tiles."""
    width = num_tiles * blocks_per_tile
    if table.shape[-1] >= width:
        return table[..., :width]
    pad = torch.zeros((*table.shape[:-1], width - table.shape[-1]), dtype=table.dtype, device=table.device)
    return torch.cat([table, pad], dim=-1)


class OnlineSoftmax:
    """Softmax attention accumulated tile by tile: running max ``m``, sum ``l`` and output ``acc``
    per query (fp32). A query that sees no key of a tile keeps its state bit for bit."""

    def __init__(self, batch: int, queries: int, head_dim: int, device: torch.device) -> None:
        self.m = torch.full((batch, queries), float("-inf"), device=device)
        self.l = torch.zeros((batch, queries), device=device)
        self.acc = torch.zeros((batch, queries, head_dim), device=device)

    def add_tile(self, scores: torch.Tensor, values: torch.Tensor) -> None:
        """``scores [batch, queries, KEY_TILE]`` (fp32, -inf where a key is hidden) over ``values
        [batch, KEY_TILE, dim]`` (fp32)."""
        tile_max = scores.amax(dim=-1)
        m_new = torch.maximum(self.m, tile_max)
        m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)  # no -inf - -inf
        p = torch.exp(scores - m_safe[..., None])
        scale = torch.exp(self.m - m_safe)
        sees_nothing = tile_max == float("-inf")
        self.m = torch.where(sees_nothing, self.m, m_new)
        self.l = torch.where(sees_nothing, self.l, self.l * scale + p.sum(dim=-1))
        self.acc = torch.where(sees_nothing[..., None], self.acc,
                               self.acc * scale[..., None] + torch.bmm(p, values))

    def result(self) -> torch.Tensor:
        """[batch, queries, dim]: 0 for a query that saw no key (padding)."""
        return self.acc / torch.where(self.l == 0, 1.0, self.l)[..., None]


def prefill_tiled(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_table: torch.Tensor, seq_len: int, sliding_window: int | None) -> torch.Tensor:
    """A prefill chunk's attention: ``query [L, heads, dim]``, the chunk's last ``L`` positions of a
    sequence of ``seq_len`` tokens whose K/V (its own included) are in the cache along ``block_table``;
    causal, and within ``sliding_window`` where set (visible iff key > query - window). Each block of
    QUERY_BLOCK tokens runs over the tiles from key 0 (or the first its window reaches) to its last."""
    length, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[-3]
    group = num_heads // num_kv_heads
    per_tile = _blocks_per_tile(k_cache)
    table = _padded_table(block_table, -(-seq_len // KEY_TILE), per_tile)
    device = query.device
    out = torch.empty(query.shape, dtype=query.dtype, device=device)
    first_position = seq_len - length
    # Every tile's K and V once for all the chunk's query blocks: [tiles, kv_heads, KEY_TILE, dim].
    tiles_shape = (-1, num_kv_heads, KEY_TILE, head_dim)
    by_tile = table.view(-1, per_tile)
    all_keys = _gather_tile(k_cache, by_tile, tiles_shape)
    all_values = _gather_tile(v_cache, by_tile, tiles_shape)
    key_offsets = torch.arange(KEY_TILE, device=device)
    for first in range(0, length, QUERY_BLOCK):
        count = min(QUERY_BLOCK, length - first)
        block = torch.zeros((QUERY_BLOCK, num_kv_heads, group, head_dim), dtype=torch.float32, device=device)
        block[:count] = query[first:first + count].view(count, num_kv_heads, group, head_dim)
        # [kv_heads, QUERY_BLOCK * group, dim]: a kv head's query heads folded into the query rows
        q = (block * head_dim ** -0.5).permute(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)
        start = first_position + first
        positions = torch.full((QUERY_BLOCK,), -1, device=device)  # padding: sees no key
        positions[:count] = torch.arange(start, start + count, device=device)
        positions = positions.repeat_interleave(group)[:, None]
        low = 0 if sliding_window is None else max(0, start - sliding_window + 1)
        high = start + count - 1
        state = OnlineSoftmax(num_kv_heads, QUERY_BLOCK * group, head_dim, device)
        for tile in range(low // KEY_TILE, high // KEY_TILE + 1):
            keys, values = all_keys[tile], all_values[tile]
            key_positions = tile * KEY_TILE + key_offsets[None, :]
            visible = key_positions <= positions
            if sliding_window is not None:
                visible &= key_positions > positions - sliding_window
            scores = torch.bmm(q, keys.transpose(1, 2)).masked_fill_(~visible, float("-inf"))
            state.add_tile(scores, values)
        result = state.result().view(num_kv_heads, QUERY_BLOCK, group, head_dim).permute(1, 0, 2, 3)
        out[first:first + count] = result[:count].reshape(count, num_heads, head_dim).to(query.dtype)
    return out


@dataclass
class DecodeBlock:
    """One call's worth of decode rows (DECODE_BLOCK_ROWS, padding included) and what it reads: the
    same for every layer of a step, so built once (``plan_decode``)."""

    rows: slice  # its real rows in the step's decode rows
    # Per group of up to TILES_PER_GATHER tiles: rows of the cache viewed [blocks * kv_heads,
    # block_size * dim] holding its tiles' K (or V), ordered (tile, row, kv head, block), and whether
    # they cover the padding rows too (reading block 0) or only the real ones (padding left as
    # allocated: whatever it holds reaches only the padding rows' own scores and outputs, every key of
    # theirs is masked, and OnlineSoftmax keeps a row's state where it sees nothing).
    gathers: list[tuple[torch.Tensor, bool]]
    # Per tile: [rows * kv_heads, group, KEY_TILE] where a query does not see a key.
    hidden: list[torch.Tensor]


def plan_decode(block_tables: torch.Tensor, seq_lens: torch.Tensor, sliding_window: int | None,
                num_kv_heads: int, group: int, block_size: int,
                num_tiles: int | None = None) -> list[DecodeBlock]:
    """Decode rows (row r at position ``seq_lens[r] - 1`` over its keys along ``block_tables [R, W]``,
    device tensors padded with block 0) in blocks of DECODE_BLOCK_ROWS; each block runs ``num_tiles``
    tiles (None: what its longest row needs, read from ``seq_lens`` on the host; given, e.g. from the
    tables' width, nothing is read from the device: a CUDA graph's step)."""
    if KEY_TILE % block_size:
        raise ValueError(f"KV block size {block_size} does not divide the key tile ({KEY_TILE})")
    per_tile = KEY_TILE // block_size
    device = block_tables.device
    rows_per_block = DECODE_BLOCK_ROWS
    key_offsets = torch.arange(KEY_TILE, device=device)
    blocks = []
    for first in range(0, block_tables.shape[0], rows_per_block):
        count = min(rows_per_block, block_tables.shape[0] - first)
        rows = slice(first, first + count)
        tiles = num_tiles if num_tiles is not None else -(-int(seq_lens[rows].max()) // KEY_TILE)
        lens = torch.zeros(rows_per_block, dtype=torch.long, device=device)  # padding rows: no key
        lens[:count] = seq_lens[rows]
        # Padding rows read block 0 where the block is at least half full: one gather pass, no copy.
        pad = 2 * count >= rows_per_block
        tables = torch.zeros((rows_per_block if pad else count, tiles * per_tile), dtype=torch.long,
                             device=device)
        tables[:count] = _padded_table(block_tables[rows], tiles, per_tile)
        gathers = []
        for tile in range(0, tiles, TILES_PER_GATHER):
            span = tables[:, tile * per_tile:(tile + TILES_PER_GATHER) * per_tile]
            span = span.reshape(span.shape[0], -1, per_tile).transpose(0, 1)  # [tiles, rows, blocks]
            gathers.append((head_major_rows(span, num_kv_heads).reshape(-1), pad))
        hidden = []
        for tile in range(tiles):
            key_positions = tile * KEY_TILE + key_offsets[None, :]
            sees = key_positions < lens[:, None]
            if sliding_window is not None:
                sees &= key_positions > lens[:, None] - 1 - sliding_window
            # [rows, keys] -> [rows * kv_heads, group, keys], as the scores
            per_query = sees[:, None, None].expand(-1, num_kv_heads, group, -1)
            hidden.append(~per_query.reshape(-1, group, KEY_TILE))
        blocks.append(DecodeBlock(rows, gathers, hidden))
    return blocks


def _gather_tiles(cache: torch.Tensor, cache_rows: torch.Tensor, padded: bool, count: int) -> torch.Tensor:
    """A tile group's K (or V) as [tiles, DECODE_BLOCK_ROWS * kv_heads, KEY_TILE, dim] fp32, each tile
    one contiguous operand (see DecodeBlock.gathers)."""
    num_kv_heads, head_dim = cache.shape[-3], cache.shape[-1]
    gathered = cache.view(-1, cache.shape[-2] * head_dim).index_select(0, cache_rows)
    if padded:
        return gathered.view(-1, DECODE_BLOCK_ROWS * num_kv_heads, KEY_TILE, head_dim).float()
    tiles = cache_rows.numel() // (count * num_kv_heads * (KEY_TILE // cache.shape[-2]))
    out = torch.empty((tiles, DECODE_BLOCK_ROWS * num_kv_heads, KEY_TILE, head_dim), device=cache.device)
    out[:, :count * num_kv_heads] = gathered.view(tiles, count * num_kv_heads, KEY_TILE, head_dim)
    return out


def decode_tiled(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor | None = None, seq_lens: torch.Tensor | None = None,
                 sliding_window: int | None = None, num_tiles: int | None = None,
                 plan: list[DecodeBlock] | None = None) -> torch.Tensor:
    """Decode rows' attention, ``query [R, heads, dim]``: along ``plan`` (``plan_decode``'s, shared by
    a step's layers), or one made here from the tables, lengths, window and ``num_tiles``."""
    num_rows, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[-3]
    group = num_heads // num_kv_heads
    if plan is None:
        assert block_tables is not None and seq_lens is not None
        plan = plan_decode(block_tables, seq_lens, sliding_window, num_kv_heads, group, k_cache.shape[-2],
                           num_tiles)
    rows_per_block = DECODE_BLOCK_ROWS
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    for block in plan:
        count = block.rows.stop - block.rows.start
        q = torch.zeros((rows_per_block, num_kv_heads, group, head_dim), device=query.device)
        q[:count] = query[block.rows].view(count, num_kv_heads, group, head_dim)
        q = q.mul_(head_dim ** -0.5).view(rows_per_block * num_kv_heads, group, head_dim)
        state = OnlineSoftmax(rows_per_block * num_kv_heads, group, head_dim, query.device)
        for tile, hidden in enumerate(block.hidden):
            if tile % TILES_PER_GATHER == 0:  # the next few tiles' K and V in one gather each
                cache_rows, padded = block.gathers[tile // TILES_PER_GATHER]
                some_keys = _gather_tiles(k_cache, cache_rows, padded, count)
                some_values = _gather_tiles(v_cache, cache_rows, padded, count)
            keys, values = some_keys[tile % TILES_PER_GATHER], some_values[tile % TILES_PER_GATHER]
            scores = torch.bmm(q, keys.transpose(1, 2)).masked_fill_(hidden, float("-inf"))
            state.add_tile(scores, values)
        result = state.result().view(rows_per_block, num_heads, head_dim)
        out[block.rows] = result[:count].to(query.dtype)
    return out


__all__ = ["DECODE_BLOCK_ROWS", "KEY_TILE", "QUERY_BLOCK", "DecodeBlock", "OnlineSoftmax", "decode_tiled",
           "plan_decode", "prefill_tiled"]
