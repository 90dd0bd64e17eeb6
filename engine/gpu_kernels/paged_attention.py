"""Paged attention in one Triton launch per layer and step: prefill chunks, decode rows, prefix hits
and chunked prefill after cached blocks alike, each reading its K/V in place through its block table.

The design follows vLLM V1's "unified" Triton attention: the step's sequences are laid end to end
(``query_start_loc``), each is cut into blocks of ``BLOCK_Q`` query tokens, and one program attends
one such block for one kv head. Its ``BLOCK_M = BLOCK_Q * GROUP`` rows are the block's tokens times
the query heads that share the kv head (GQA without repeating K/V), so a decode row is simply a
sequence of one query token. Keys are read a tile of ``TILE`` tokens at a time, each token at
``block_tables[seq, key // block_size]``, with an online softmax across tiles (flash attention).

Why this and not a library: the installed torch has no paged attention op usable per step
(FlexAttention's paged variant rebuilds a block mask on the host every step); FlashAttention and
FlashInfer are CUDA builds that the GPU machines here do not carry, and neither runs in CI. A Triton
kernel of ours runs on the GPU's torch/Triton and, under Triton's interpreter, on CPU tensors in CI.

Batch invariance comes by construction: a row's keys are reduced in tiles from key 0 (or from the
first tile its sliding window sees) in order, one program per (query block, kv head), no split of
the keys across programs; rows of a program never mix (each score and output row is its own dot
products), and fully masked tiles change nothing bitwise (``exp(-inf) = 0``, ``alpha = 1``). With
``fixed_blocks=True`` the tile sizes are the same for every step and a token's row in its program
follows from its position alone, so a row's bits do not depend on which rows share its step or how
its prompt was chunked.

Cache layout: ``[num_blocks, kv_heads, block_size, head_dim]`` per K and V (the engine's, on every
device: one kv head's tokens of a block are one contiguous run, so a tile of keys is one contiguous
read; FlashInfer calls it HND). The kernel takes strides, so a ``[num_blocks, block_size, kv_heads,
head_dim]`` cache (NHD, FlashAttention's) passed as its ``permute(0, 2, 1, 3)`` view works too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from bulkinfer.engine.gpu_kernels import LONG_QUERY

# Triton 3.9's interpreter computes tl.dot of bf16/fp16 operands wrongly (numpy has no bf16): under
# it the operands are widened to fp32 first. Compiled kernels keep 16-bit operands (tensor cores).
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class StepLayout:
    """Where a step's sequences are, on the attention's device (built once per step, read by every
    layer): ``query_start_loc [S + 1]``, ``seq_lens [S]`` (context + new tokens), ``block_tables [S,
    W]`` (int32 or int64), and ``max_query_len`` (a host int: it picks the tile shape)."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int


@triton.jit
def _tanh(x):
    # tanh from exp (no libdevice: the interpreter and every Triton version have exp).
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr, WIDEN: tl.constexpr):
    if WIDEN:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")  # fp32 models: no TF32 rounding of Q/K/V
    return tl.dot(a, b)


@triton.jit
def _find_sequence(query_start_loc_ptr, num_seqs, pid, BLOCK_Q: tl.constexpr, SLOTS: tl.constexpr):
    """The sequence whose query blocks hold program `pid`: sequence s's blocks start at
    ``query_start_loc[s] // BLOCK_Q + SLOTS * s`` (enough for its blocks, never overlapping)."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + SLOTS * mid
        if start <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _unified_attention(
    q_ptr, k_ptr, v_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    num_seqs, scale, softcap,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_k_blk, stride_k_head, stride_k_tok, stride_v_blk, stride_v_head, stride_v_tok,
    stride_table,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE: tl.constexpr, SLIDING_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, IEEE: tl.constexpr, WIDEN: tl.constexpr, ALIGNED: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    # ALIGNED: query blocks are cut at multiples of BLOCK_Q of the absolute position, not from a
    # chunk's first token, so a token always takes the same row of its program whatever its chunk
    # (a row's bits may depend on its row: numpy's matmul under the interpreter shows it). A chunk
    # then spans up to 2 more blocks than its length needs: 2 grid slots a sequence.
    seq = _find_sequence(query_start_loc_ptr, num_seqs, pid, BLOCK_Q, 2 if ALIGNED else 1)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len
    q_block = pid - (q_start // BLOCK_Q + (2 if ALIGNED else 1) * seq)
    if ALIGNED:
        block_pos = (context // BLOCK_Q + q_block) * BLOCK_Q  # absolute position of the block's row 0
    else:
        block_pos = context + q_block * BLOCK_Q
    if block_pos >= seq_len:
        return

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_P)
    d_valid = offs_d < HEAD_DIM
    q_pos = block_pos + offs_m // GROUP  # absolute position of each row's token
    q_local = q_pos - context  # its index among the sequence's new tokens
    head = kv_head * GROUP + offs_m % GROUP
    row_valid = (offs_m < BLOCK_Q * GROUP) & (q_local >= 0) & (q_local < q_len)
    token = q_start + q_local
    q = tl.load(q_ptr + token[:, None] * stride_q_tok + head[:, None] * stride_q_head + offs_d[None, :],
                mask=row_valid[:, None] & d_valid[None, :], other=0.0)

    # Keys this block reads: up to its last token; with a window, from the first key its first token sees.
    num_keys = tl.minimum(block_pos + BLOCK_Q, seq_len)
    first_tile = 0
    if SLIDING_WINDOW > 0:
        first_tile = tl.maximum(tl.maximum(block_pos, context) - SLIDING_WINDOW + 1, 0) // TILE
    num_tiles = tl.cdiv(num_keys, TILE)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], dtype=tl.float32)
    offs_t = tl.arange(0, TILE)
    table = block_tables_ptr + seq * stride_table
    for tile in range(first_tile, num_tiles):
        key_pos = tile * TILE + offs_t
        key_valid = key_pos < num_keys
        block = tl.load(table + key_pos // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        in_block = key_pos % BLOCK_SIZE
        k = tl.load(k_ptr + block[None, :] * stride_k_blk + kv_head * stride_k_head
                    + in_block[None, :] * stride_k_tok + offs_d[:, None],
                    mask=d_valid[:, None] & key_valid[None, :], other=0.0)  # [HEAD_DIM_P, TILE]
        scores = _dot(q, k, IEEE, WIDEN) * scale
        if USE_SOFTCAP:
            scores = softcap * _tanh(scores / softcap)
        visible = (key_pos[None, :] <= q_pos[:, None]) & key_valid[None, :] & row_valid[:, None]
        if SLIDING_WINDOW > 0:  # transformers' rule: visible iff key_pos > query_pos - window
            visible = visible & (key_pos[None, :] > q_pos[:, None] - SLIDING_WINDOW)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_base = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
        p = tl.exp(scores - m_base[:, None])
        alpha = tl.exp(m_i - m_base)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + block[:, None] * stride_v_blk + kv_head * stride_v_head
                    + in_block[:, None] * stride_v_tok + offs_d[None, :],
                    mask=key_valid[:, None] & d_valid[None, :], other=0.0)  # [TILE, HEAD_DIM_P]
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE, WIDEN)
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + token[:, None] * stride_o_tok + head[:, None] * stride_o_head + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_valid[None, :])


@triton.jit
def _store_kv(
    key_ptr, value_ptr, k_ptr, v_ptr, slot_ptr, num_tokens,
    stride_key_tok, stride_key_head, stride_value_tok, stride_value_head,
    stride_k_blk, stride_k_head, stride_k_tok, stride_v_blk, stride_v_head, stride_v_tok,
    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TOKENS: tl.constexpr,
):
    # One program: TOKENS tokens of one kv head.
    tokens = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    head = tl.program_id(1)
    slots = tl.load(slot_ptr + tokens, mask=tokens < num_tokens, other=-1).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM_P)
    mask = (slots[:, None] >= 0) & (offs_d[None, :] < HEAD_DIM)  # a negative slot: a padded row
    block = slots // BLOCK_SIZE
    in_block = slots % BLOCK_SIZE
    k = tl.load(key_ptr + tokens[:, None] * stride_key_tok + head * stride_key_head + offs_d[None, :],
                mask=mask)
    v = tl.load(value_ptr + tokens[:, None] * stride_value_tok + head * stride_value_head + offs_d[None, :],
                mask=mask)
    tl.store(k_ptr + block[:, None] * stride_k_blk + head * stride_k_head + in_block[:, None] * stride_k_tok
             + offs_d[None, :], k.to(k_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptr + block[:, None] * stride_v_blk + head * stride_v_head + in_block[:, None] * stride_v_tok
             + offs_d[None, :], v.to(v_ptr.dtype.element_ty), mask=mask)


STORE_TOKENS = 16  # tokens a store program writes (a decode step's rows are few, a prefill's many)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write ``key``/``value [T, kv_heads, head_dim]`` (head_dim contiguous) to their slots
    (``block * block_size + offset``; a negative slot is skipped) of ``k_cache``/``v_cache``
    ``[blocks, kv_heads, block_size, head_dim]`` (any strides, head_dim contiguous): one launch."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _require_unit_last_stride(key, value, k_cache, v_cache)
    grid = (triton.cdiv(num_tokens, STORE_TOKENS), num_kv_heads)
    _store_kv[grid](
        key, value, k_cache, v_cache, slot_mapping, num_tokens,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HEAD_DIM_P=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=k_cache.shape[2], TOKENS=STORE_TOKENS,
    )


def tile_shape(group: int, head_dim: int, max_query_len: int, fixed: bool) -> tuple[int, int]:
    """(BLOCK_M, TILE) for a step. BLOCK_M is at least 16 (tensor-core tiles) and holds a whole GQA
    group; a step with long prefill chunks takes 64 rows a program (4x the work per K/V tile read),
    unless the shapes must be fixed (batch invariance), when every step uses the smaller one. TILE
    depends on head_dim alone: 64 keys at head_dim <= 128, else 32 (registers)."""
    block_m = max(16, triton.next_power_of_2(group))
    if not fixed and max_query_len >= LONG_QUERY and block_m < 64:
        block_m = 64
    return block_m, 64 if head_dim <= 128 else 32


def unified_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, step: StepLayout,
                      out: torch.Tensor | None = None, sliding_window: int | None = None,
                      softcap: float | None = None, scale: float | None = None,
                      fixed_blocks: bool = False) -> torch.Tensor:
    """Attention of ``query [T, heads, head_dim]`` (T = the step's tokens, in ``step``'s order) over
    each sequence's cached context and its own new tokens (causal), read from ``k_cache``/``v_cache``
    ``[blocks, kv_heads, block_size, head_dim]`` through ``step.block_tables``. Returns ``out``
    (``[T, heads, head_dim]``, allocated when None). ``softcap``: scores = cap * tanh(scores / cap)
    (Gemma 2's attention soft-cap); ``scale``: default head_dim ** -0.5; ``fixed_blocks``: the same
    tile shapes every step (batch invariance)."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not divide into {num_kv_heads} kv heads")
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    num_seqs = step.seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    _require_unit_last_stride(query, out, k_cache, v_cache)
    block_m, tile = tile_shape(group, head_dim, step.max_query_len, fixed_blocks)
    block_q = block_m // group
    # Every sequence's blocks: at most T // BLOCK_Q + S programs (+ 2S aligned); the spare ones
    # return at once. The grid depends on T and S only: a fixed-shape step (a CUDA graph's) launches
    # the same grid every time.
    grid = (num_tokens // block_q + (2 if fixed_blocks else 1) * num_seqs, num_kv_heads)
    _unified_attention[grid](
        query, k_cache, v_cache, out, step.block_tables, step.seq_lens, step.query_start_loc,
        num_seqs, head_dim ** -0.5 if scale is None else scale, softcap or 0.0,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        step.block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_P=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size, BLOCK_Q=block_q, BLOCK_M=block_m, TILE=tile,
        SLIDING_WINDOW=sliding_window or 0, USE_SOFTCAP=bool(softcap),
        IEEE=query.dtype == torch.float32, WIDEN=INTERPRET, ALIGNED=fixed_blocks,
    )
    return out


def _require_unit_last_stride(*tensors: torch.Tensor) -> None:
    for tensor in tensors:
        if tensor.stride(-1) != 1:
            raise ValueError(f"the kernel reads head_dim contiguously; got strides {tensor.stride()}")
