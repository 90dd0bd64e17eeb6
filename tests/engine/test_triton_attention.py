"""The Triton paged-attention kernels (engine/gpu_kernels/paged_attention.py) against a reference
attention computed in float64 from the same cache, for every case one launch must cover: decode rows,
prefill chunks from scratch, chunked prefill continuing after cached blocks (not block-aligned),
prefix hits sharing physical blocks, GQA groups of 1, 3 and 4, a head_dim that is not a power of two,
sliding windows whose first tiles are skipped, a logit soft-cap, both cache layouts, and batch
invariance (a row's bits alone and in any batch, however its prompt was chunked).

On CPU the kernels run under Triton's interpreter (set below, before the kernels are imported); with
BULKINFER_TEST_DEVICE=cuda (benchmarks/gpu_check.sh) the same tests run the compiled kernels."""

from __future__ import annotations

import os

if os.environ.get("BULKINFER_TEST_DEVICE", "cpu") != "cuda":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import itertools  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from bulkinfer.engine.gpu_kernels.paged_attention import StepLayout, store_kv, unified_attention  # noqa: E402

DEVICE = torch.device(os.environ.get("BULKINFER_TEST_DEVICE", "cpu"))
BLOCK_SIZE = 16
NUM_BLOCKS = 48


def make_step(seqs: list[tuple[int, int]], shared_blocks: int = 0, seed: int = 0
              ) -> tuple[StepLayout, list[list[int]]]:
    """A step of sequences given as (new tokens, context + new tokens); the first `shared_blocks`
    blocks of every sequence are the same physical blocks (a prefix hit); the rest are scattered."""
    generator = torch.Generator().manual_seed(seed)
    free = (torch.randperm(NUM_BLOCKS - 1 - shared_blocks, generator=generator) + 1 + shared_blocks).tolist()
    tables = []
    for _, seq_len in seqs:
        own = -(-seq_len // BLOCK_SIZE) - shared_blocks
        tables.append(list(range(1, 1 + shared_blocks)) + [free.pop() for _ in range(own)])
    width = max(map(len, tables))
    padded = torch.tensor([table + [0] * (width - len(table)) for table in tables])
    starts = torch.tensor(list(itertools.accumulate((q for q, _ in seqs), initial=0)))
    step = StepLayout(starts.to(DEVICE), torch.tensor([s for _, s in seqs]).to(DEVICE), padded.to(DEVICE),
                      max(q for q, _ in seqs))
    return step, tables


def make_cache(kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 1) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, kv_heads, BLOCK_SIZE, head_dim)
    return tuple(torch.randn(shape, generator=generator).to(DEVICE, dtype) for _ in range(2))


def reference(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              seqs: list[tuple[int, int]], tables: list[list[int]], window: int | None = None,
              softcap: float | None = None) -> torch.Tensor:
    """float64 attention of each sequence's new tokens over its context read through its table."""
    num_heads, head_dim = query.shape[1:]
    group = num_heads // k_cache.shape[1]
    out, start = torch.empty(query.shape, dtype=torch.float64), 0
    for (q_len, seq_len), table in zip(seqs, tables, strict=True):
        def context(cache: torch.Tensor, table: list[int] = table, seq_len: int = seq_len) -> torch.Tensor:
            rows = cache.cpu().double()[table].transpose(1, 2).reshape(-1, cache.shape[1], head_dim)[:seq_len]
            return rows.repeat_interleave(group, 1)  # [seq_len, heads, dim]

        keys, values = context(k_cache), context(v_cache)
        q = query[start:start + q_len].cpu().double()
        scores = torch.einsum("thd,khd->htk", q, keys) * head_dim ** -0.5
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        visible = k_pos <= q_pos
        if window:
            visible &= k_pos > q_pos - window
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start:start + q_len] = torch.einsum("htk,khd->thd", scores.softmax(-1), values)
        start += q_len
    return out


def random_query(num_tokens: int, heads: int, head_dim: int, dtype: torch.dtype,
                 seed: int = 2) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, heads, head_dim, generator=generator).to(DEVICE, dtype)


TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2}
# decode rows (short and long context), a prompt from scratch, a chunk after 37 cached tokens (not
# block-aligned), a chunk right after a prefix hit, a one-token prompt
MIXED = [(1, 9), (1, 70), (1, 33), (21, 21), (11, 48), (8, 40), (1, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("kv_heads", "group", "head_dim", "fixed_blocks"),
                         [(2, 1, 16, False), (1, 3, 32, True), (2, 4, 48, False)],
                         ids=["mha", "gqa3-fixed-blocks", "gqa4-dim48"])
def test_a_mixed_step_matches_reference_attention(dtype, kv_heads, group, head_dim, fixed_blocks):
    step, tables = make_step(MIXED)
    k_cache, v_cache = make_cache(kv_heads, head_dim, dtype)
    query = random_query(int(step.query_start_loc[-1]), kv_heads * group, head_dim, dtype)
    out = unified_attention(query, k_cache, v_cache, step, fixed_blocks=fixed_blocks)
    expected = reference(query, k_cache, v_cache, MIXED, tables)
    assert out.dtype == dtype and out.shape == query.shape
    torch.testing.assert_close(out.cpu().double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_prefix_hits_read_the_same_physical_blocks():
    seqs = [(5, 37), (1, 40), (16, 50)]  # every context starts with the same 2 blocks
    step, tables = make_step(seqs, shared_blocks=2)
    assert all(table[:2] == [1, 2] for table in tables)
    k_cache, v_cache = make_cache(2, 32, torch.float32)
    query = random_query(22, 4, 32, torch.float32)
    out = unified_attention(query, k_cache, v_cache, step)
    torch.testing.assert_close(out.cpu().double(), reference(query, k_cache, v_cache, seqs, tables),
                               atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(("window", "fixed_blocks"), [(5, False), (20, True)])
def test_sliding_windows_skip_the_tiles_no_row_sees(window, fixed_blocks):
    # 150 tokens of context: with 64-key tiles a decode row's window starts in the third tile.
    seqs = [(1, 150), (12, 140), (1, 3), (9, 9)]
    step, tables = make_step(seqs)
    k_cache, v_cache = make_cache(2, 16, torch.float32)
    query = random_query(23, 4, 16, torch.float32)
    out = unified_attention(query, k_cache, v_cache, step, sliding_window=window, fixed_blocks=fixed_blocks)
    expected = reference(query, k_cache, v_cache, seqs, tables, window=window)
    torch.testing.assert_close(out.cpu().double(), expected, atol=2e-5, rtol=2e-5)


def test_a_logit_soft_cap_bounds_the_scores():
    step, tables = make_step(MIXED)
    k_cache, v_cache = make_cache(1, 16, torch.float32)
    query = random_query(int(step.query_start_loc[-1]), 2, 16, torch.float32) * 8  # scores well past the cap
    out = unified_attention(query, k_cache, v_cache, step, softcap=5.0)
    expected = reference(query, k_cache, v_cache, MIXED, tables, softcap=5.0)
    torch.testing.assert_close(out.cpu().double(), expected, atol=2e-5, rtol=2e-5)
    assert not torch.allclose(expected, reference(query, k_cache, v_cache, MIXED, tables), atol=1e-3)


def test_a_token_major_cache_read_through_its_strides_gives_the_same_bits():
    """FlashAttention's [blocks, block_size, kv_heads, dim] layout, passed as a permuted view."""
    step, _ = make_step(MIXED)
    k_cache, v_cache = make_cache(2, 32, torch.float32)
    k_nhd, v_nhd = (cache.transpose(1, 2).contiguous() for cache in (k_cache, v_cache))
    query = random_query(int(step.query_start_loc[-1]), 6, 32, torch.float32)
    head_major = unified_attention(query, k_cache, v_cache, step)
    token_major = unified_attention(query, k_nhd.transpose(1, 2), v_nhd.transpose(1, 2), step)
    assert torch.equal(head_major, token_major)


def test_fixed_blocks_make_a_row_the_same_bits_alone_in_a_batch_and_however_its_prompt_was_chunked():
    k_cache, v_cache = make_cache(1, 32, torch.float32)
    # A 40-token prompt in one chunk, alone ...
    step, tables = make_step([(40, 40)])
    query = random_query(40, 3, 32, torch.float32)
    alone = unified_attention(query, k_cache, v_cache, step, fixed_blocks=True)
    # ... and as a 25-token chunk after 15 cached tokens, in a batch behind two decode rows.
    batch = [(1, 30), (1, 55), (25, 40)]
    starts = torch.tensor([0, 1, 2, 27])
    batch_tables = torch.tensor([[9, 10, 0], [11, 12, 13], tables[0]])
    batch_step = StepLayout(starts.to(DEVICE), torch.tensor([s for _, s in batch]).to(DEVICE),
                            batch_tables.to(DEVICE), 25)
    batch_query = torch.cat([random_query(2, 3, 32, torch.float32, seed=5), query[15:]])
    batched = unified_attention(batch_query, k_cache, v_cache, batch_step, fixed_blocks=True)
    assert torch.equal(batched[2:], alone[15:])
    # The last token once more as a decode row of its own.
    decode_step = StepLayout(torch.tensor([0, 1]).to(DEVICE), torch.tensor([40]).to(DEVICE),
                             torch.tensor([tables[0]]).to(DEVICE), 1)
    assert torch.equal(unified_attention(query[39:], k_cache, v_cache, decode_step, fixed_blocks=True),
                       alone[39:])


@pytest.mark.parametrize("token_major", [False, True], ids=["head-major", "token-major"])
def test_store_kv_writes_each_token_to_its_slot_and_skips_negative_slots(token_major):
    kv_heads, head_dim = 3, 24
    k_cache, v_cache = (torch.zeros(8, kv_heads, BLOCK_SIZE, head_dim, device=DEVICE) for _ in range(2))
    if token_major:  # the same logical cache over [blocks, block_size, kv_heads, dim] memory
        k_cache, v_cache = (torch.zeros(8, BLOCK_SIZE, kv_heads, head_dim, device=DEVICE).transpose(1, 2)
                            for _ in range(2))
    # 20 tokens: a fused QKV's K and V views (head_dim contiguous, rows strided), one padded row
    qkv = torch.randn(20, 2 * kv_heads * head_dim + 8, device=DEVICE)
    key = qkv[:, 8:8 + kv_heads * head_dim].view(20, kv_heads, head_dim)
    value = qkv[:, 8 + kv_heads * head_dim:].view(20, kv_heads, head_dim)
    slots = torch.randperm(8 * BLOCK_SIZE)[:20].to(DEVICE)
    slots[7] = -1
    store_kv(key, value, k_cache, v_cache, slots)
    for token, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, BLOCK_SIZE)
        assert torch.equal(k_cache[block, :, offset], key[token])
        assert torch.equal(v_cache[block, :, offset], value[token])
    assert int((k_cache != 0).any(-1).sum()) == 19 * kv_heads  # nothing else written
