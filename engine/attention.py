"""Paged attention over the flattened batch.

KV cache per layer: ``[2, num_blocks, num_kv_heads, block_size, head_dim]`` (index 0 = K, 1 = V),
head-major inside a block: one kv head's tokens of a block are one contiguous ``block_size *
head_dim`` run, so reading a request's context copies whole runs (not one ``head_dim`` row per
token and head), and a gathered context is already in the attention kernel's ``[kv_heads, L, dim]``
layout. New K/V rows are written through the slot mapping (``block_id * block_size + offset``);
attention then reads each request's context through its block table, so a request only ever sees
its own blocks (shared prefix blocks included).

The runner orders the flattened batch as: decode requests first (one query token each), then
prefill chunks (several query tokens each). Decodes run as one batched computation; prefill chunks
run one fused SDPA call each — there are few per step (the token budget bounds them) and each is
large, so the per-request call overhead is negligible next to its own work.

Decode attention is memory-bound: every step reads each request's whole context. When decode
requests share leading KV blocks (a prefix-cache hit on a common instruction), the shared part is
attended once per group as one matrix-matrix product ("cascade" attention), each request reads
only its own blocks, and the two partial results are merged exactly through their log-sum-exps.
Decode rows are gathered and attended a few rows at a time, so the gathered K/V of a chunk is still
in cache when the kernel reads it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from bulkinfer.engine.cache_rows import gather_cache_rows, head_major_rows
from bulkinfer.engine.invariant.tiled_attention import KEY_TILE, decode_tiled, prefill_tiled
from bulkinfer.engine.invariant.tiled_attention import plan_decode as plan_tiled_decode

if TYPE_CHECKING:
    from bulkinfer.engine.cpu_kernels import CpuKernels


@dataclass
class AttentionMetadata:
    """Where each request's tokens and KV blocks are, for one step."""

    block_size: int
    slot_mapping: torch.Tensor  # [T] int64: cache slot of every new token
    # Decode requests: rows [0, num_decodes) of the batch, one token each.
    num_decodes: int
    # Host (CPU) tensors whatever the device: the decode plan is worked out on the host once per
    # step (grouping needs data-dependent shapes), so a GPU step never waits on a device read.
    decode_seq_lens: torch.Tensor  # [num_decodes] context length including the new token
    decode_block_tables: torch.Tensor  # [num_decodes, max_decode_blocks], padded with block 0
    # [num_decodes] bool (host), or None: rows never grouped with others over a shared prefix, so
    # each computes exactly as a lone decode would (speculative verification's positions).
    decode_solo: torch.Tensor | None = None
    # Prefill chunks follow the decodes; plain lists because they are iterated in Python.
    prefill_query_starts: list[int] = field(default_factory=list)
    prefill_query_lens: list[int] = field(default_factory=list)
    prefill_seq_lens: list[int] = field(default_factory=list)
    prefill_block_tables: list[torch.Tensor] = field(default_factory=list)
    # The same block ids on the host, for planning without reading device tensors (empty: read
    # from prefill_block_tables).
    prefill_block_lists: list[list[int]] = field(default_factory=list)
    # A pure decode step of fixed shapes (engine/decode_graphs.py, a CUDA graph's step): the decode
    # seq lens and block tables are then device tensors, padded rows included, and attention reads
    # them on the device (every row gathered to the tables' width, masked by its length) with no
    # host planning, so the step's kernels are the same every time.
    static_decode: bool = False
    # A step of fixed shapes with prefill chunks (engine/mixed_graphs.py, a CUDA graph's): its
    # whole-step layout below (query_start_loc, seq_lens, block_tables) is device buffers, padded
    # sequences included, and attention reads only that; `static_max_query_len` stands for the
    # step's longest chunk where a kernel picks its tile shape (the same for every replay).
    static_step: bool = False
    static_max_query_len: int = 1
    # Every row in batch order (decodes, then prefill chunks), on the host: what a backend that attends
    # the whole step in one launch reads (engine/gpu_kernels/). None: derived from the fields above.
    query_start_loc: torch.Tensor | None = None  # [rows + 1]
    seq_lens: torch.Tensor | None = None  # [rows] context + new tokens
    block_tables: torch.Tensor | None = None  # [rows, max blocks], padded with block 0
    # Values derived once per step and shared by all layers (masks, the backend's decode plan).
    step_cache: dict[tuple[Any, ...], Any] = field(default_factory=dict, repr=False)

    @property
    def num_prefills(self) -> int:
        return len(self.prefill_query_lens)

    @property
    def fixed_shape(self) -> bool:
        """Whether this step's shapes are fixed (a CUDA graph's): no host planning, no host reads."""
        return self.static_decode or self.static_step

    def prefill_mask(self, index: int, sliding_window: int | None) -> torch.Tensor | None:
        """[q_len, seq_len] causal-with-offset mask, or None when plain causal applies."""
        query_len, seq_len = self.prefill_query_lens[index], self.prefill_seq_lens[index]
        if query_len == seq_len and (sliding_window is None or seq_len <= sliding_window):
            return None
        key = (f"prefill{index}", sliding_window)
        if key not in self.step_cache:
            device = self.slot_mapping.device
            query_pos = torch.arange(seq_len - query_len, seq_len, device=device)[:, None]
            key_pos = torch.arange(seq_len, device=device)[None, :]
            valid = key_pos <= query_pos
            if sliding_window is not None:
                valid &= key_pos > query_pos - sliding_window
            self.step_cache[key] = valid
        return self.step_cache[key]  # type: ignore[return-value]


class AttentionBackend(ABC):
    """Writes new K/V into the paged cache and attends over each request's context."""

    # Whether a fixed-shape decode step copies its rows' K/V out of the cache (engine/decode_graphs.py
    # bounds such a step's size by that copy); a backend that reads the cache in place says False.
    gathers_kv: bool = True

    @abstractmethod
    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> None:
        """Store key/value ``[T, kv_heads, head_dim]`` at ``metadata.slot_mapping``."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        sliding_window: int | None = None,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query ``[T, heads, head_dim]`` -> attention output ``[T, heads, head_dim]``.

        ``key``/``value``: this step's new K/V (``[T, kv_heads, head_dim]``, already written to the
        cache); a backend may read them directly where a chunk has no earlier context.
        """


def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
    """Attention over two disjoint parts of a context, merged exactly through their log-sum-exps;
    in fp32 (the LSEs are fp32), the result in ``dtype``."""
    total = torch.logaddexp(lse_a, lse_b)
    return (out_a.float() * torch.exp(lse_a - total)[..., None]
            + out_b.float() * torch.exp(lse_b - total)[..., None]).to(dtype)


@dataclass
class SharedPrefix:
    """Decode rows whose block tables start with the same blocks."""

    rows: torch.Tensor  # [n] decode rows of the group
    block_ids: torch.Tensor  # [k] the shared leading blocks (all full)


@dataclass
class PrefixBatch:
    """Shared prefixes of one shape (rows per group, blocks): attended in one batched kernel call.
    Several instructions in one step (several jobs, or a job whose rows use a few) are common."""

    rows: torch.Tensor  # [groups * n] the decode rows, group after group
    block_ids: torch.Tensor  # [groups, k] each group's shared blocks
    # Rows of the cache viewed [blocks * kv_heads, block_size * dim], ordered (group, head, block):
    # one gather gives every group's K (or V) as [groups, kv_heads, k * block_size, dim].
    cache_rows: torch.Tensor
    groups: int


def batch_prefixes(prefixes: list[SharedPrefix], num_kv_heads: int) -> list[PrefixBatch]:
    by_shape: dict[tuple[int, int], list[SharedPrefix]] = {}
    for prefix in prefixes:
        by_shape.setdefault((len(prefix.rows), len(prefix.block_ids)), []).append(prefix)
    batches = []
    for members in by_shape.values():
        blocks = torch.stack([prefix.block_ids for prefix in members])  # [groups, k]
        cache_rows = head_major_rows(blocks, num_kv_heads).reshape(-1)
        batches.append(PrefixBatch(torch.cat([prefix.rows for prefix in members]), blocks, cache_rows,
                                   len(members)))
    return batches


@dataclass
class PrefillGroup:
    """Prefill chunks of one step whose cached context starts with the same full blocks (a shared
    instruction): those blocks are attended once for every query token of the group."""

    chunks: list[int]  # prefill indices, in batch order
    block_ids: torch.Tensor  # [k] the shared leading blocks
    token_rows: torch.Tensor  # [T] rows of the flattened batch holding the chunks' query tokens


def plan_prefill_groups(metadata: AttentionMetadata, min_shared_tokens: int) -> list[PrefillGroup]:
    """Group prefill chunks by common leading blocks of their already-computed context (never of
    their own query tokens), when that saves at least ``min_shared_tokens`` token reads. Works on
    host block lists: no device read."""
    block_size = metadata.block_size
    seq_lens, query_lens = metadata.prefill_seq_lens, metadata.prefill_query_lens
    lists = metadata.prefill_block_lists or [table.tolist() for table in metadata.prefill_block_tables]
    by_first: dict[int, list[int]] = {}
    for i, blocks in enumerate(lists):
        if (seq_lens[i] - query_lens[i]) // block_size >= 1:
            by_first.setdefault(blocks[0], []).append(i)
    groups = []
    for chunks in by_first.values():
        if len(chunks) < 2:
            continue
        shared = min((seq_lens[i] - query_lens[i]) // block_size for i in chunks)
        first = lists[chunks[0]]
        for i in chunks[1:]:
            shared = next((j for j in range(shared) if lists[i][j] != first[j]), shared)
        if shared * block_size * (len(chunks) - 1) < max(min_shared_tokens, 1):
            continue
        starts = metadata.prefill_query_starts
        token_rows = [row for i in chunks for row in range(starts[i], starts[i] + query_lens[i])]
        device = metadata.slot_mapping.device
        groups.append(PrefillGroup(chunks, torch.tensor(first[:shared], device=device),
                                   torch.tensor(token_rows, device=device)))
    return groups


@dataclass
class DecodePlan:
    """How decode rows read their context this step; computed once, used by every layer.

    Each row's own part (its context after its shared prefix) is described twice over, for the two
    ways of attending it: block tables for the native kernel, or cache rows and a key bias for the
    PyTorch path (only the one the backend uses is built)."""

    shared_prefixes: list[SharedPrefix]
    prefix_batches: list[PrefixBatch]
    # Native kernel: row r reads tokens [own_first[r], own_tokens[r]) along own_tables[r].
    own_tables: torch.Tensor | None = None  # [R, W] block ids, padded with block 0
    own_tokens: torch.Tensor | None = None  # [R]
    own_first: torch.Tensor | None = None  # [R] > 0 only under a sliding window
    # PyTorch path: each row's own part as rows of the cache viewed [blocks * kv_heads,
    # block_size * dim], ordered [R, kv_heads, S]: gathering them yields K/V already in the
    # attention kernel's [R, kv_heads, L, dim] layout.
    own_cache_rows: torch.Tensor | None = None  # [R, kv_heads * S], L = S * block_size
    own_key_bias: torch.Tensor | None = None  # [R, 1, 1, L] 0 where a key is visible, -inf elsewhere


def plan_decode(
    metadata: AttentionMetadata, sliding_window: int | None, min_shared_tokens: int, num_kv_heads: int,
    for_kernel: bool = False, min_rows: int = 2,
) -> DecodePlan:
    """Find groups of at least ``min_rows`` decode rows with common leading blocks (worth it when they
    save at least ``min_shared_tokens`` token reads) and what each row reads on its own."""
    tables, seq_lens, block_size = metadata.decode_block_tables, metadata.decode_seq_lens, metadata.block_size
    num_rows, num_cols = tables.shape
    shift = torch.zeros(num_rows, dtype=torch.long)
    prefixes: list[SharedPrefix] = []
    if sliding_window is None and num_rows > 1:
        # A row's last token always stays in its own part, so the own part is never empty.
        shareable = (seq_lens - 1) // block_size
        first_blocks = tables[:, 0]
        if metadata.decode_solo is not None and bool(metadata.decode_solo.any()):
            first_blocks = first_blocks.clone()  # a solo row gets a key of its own: a group of one
            first_blocks[metadata.decode_solo] = -1 - torch.arange(int(metadata.decode_solo.sum()))
        _, group_of_row, group_sizes = torch.unique(first_blocks, return_inverse=True, return_counts=True)
        for group in (group_sizes >= max(min_rows, 2)).nonzero().flatten().tolist():
            rows = (group_of_row == group).nonzero().flatten()
            group_tables = tables[rows]
            leading_equal = int((group_tables == group_tables[0]).all(0).cumprod(0).sum())
            num_shared = min(leading_equal, int(shareable[rows].min()))
            if num_shared * block_size * (len(rows) - 1) < max(min_shared_tokens, 1):
                continue
            prefixes.append(SharedPrefix(rows, group_tables[0, :num_shared].clone()))
            shift[rows] = num_shared

    num_own_blocks = (seq_lens + block_size - 1) // block_size - shift
    width = int(num_own_blocks.max())
    cols = torch.arange(width)[None, :]
    own_tables = tables.gather(1, (shift[:, None] + cols).clamp(max=num_cols - 1))
    own_tables.masked_fill_(cols >= num_own_blocks[:, None], 0)
    device = metadata.slot_mapping.device
    if device.type != "cpu":
        prefixes = [SharedPrefix(p.rows.to(device), p.block_ids.to(device)) for p in prefixes]
    batches = batch_prefixes(prefixes, num_kv_heads)
    if for_kernel:
        own_tokens = seq_lens - shift * block_size
        first = torch.zeros_like(own_tokens)
        if sliding_window is not None:  # visible iff key_pos >= seq_len - window (transformers' rule)
            first = (own_tokens - sliding_window).clamp(min=0)
        return DecodePlan(prefixes, batches, own_tables=own_tables, own_tokens=own_tokens, own_first=first)
    local_pos = torch.arange(width * block_size)
    cache_rows = head_major_rows(own_tables, num_kv_heads)
    key_pos = shift[:, None] * block_size + local_pos[None, :]
    return DecodePlan(prefixes, batches, own_cache_rows=cache_rows.reshape(num_rows, -1).to(device),
                      own_key_bias=decode_key_bias(key_pos, seq_lens, sliding_window).to(device))


def decode_key_bias(key_pos: torch.Tensor, seq_lens: torch.Tensor,
                    sliding_window: int | None) -> torch.Tensor:
    """[rows, 1, 1, keys] fp32 attention bias of decode rows (one query each, at seq_len - 1) over
    keys at positions ``key_pos [rows or 1, keys]``: 0 where visible, -inf past the row's length
    or, with a window, transformers' rule: visible iff key_pos > query_pos - window."""
    visible = key_pos < seq_lens[:, None]
    if sliding_window is not None:
        visible &= key_pos > seq_lens[:, None] - 1 - sliding_window
    bias = torch.zeros(visible.shape, dtype=torch.float32, device=visible.device)
    return bias.masked_fill_(~visible, float("-inf"))[:, None, None, :]


# K+V bytes a GPU gathers per decode call: enough for SmolLM2's 512 rows at 480 keys (188 MB) in one
# call, and bounded: the gather and its fp32 scores come out of the memory the KV cache leaves free.
GPU_DECODE_CHUNK_BYTES = 256 << 20


def decode_chunk_rows(device: torch.device, row_bytes: int, num_rows: int, chunk_bytes: int) -> int:
    """Decode rows gathered and attended per call on the PyTorch path. On CPU a chunk's K/V stays in
    the last-level cache between its gather and its attention (`chunk_bytes`, 16 MiB: 45 of SmolLM2's
    rows at 480 keys); a GPU has no such reuse to win and pays for every launch (12 chunks of ~10
    kernels a layer at 512 rows), so there a chunk is GPU_DECODE_CHUNK_BYTES."""
    budget = chunk_bytes if device.type == "cpu" else max(chunk_bytes, GPU_DECODE_CHUNK_BYTES)
    return max(1, min(num_rows, budget // row_bytes))


def attention_with_lse(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bias: torch.Tensor | None = None,
    use_cpu_kernel: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention [..., q, dim] over [..., k, dim] and its log-sum-exp [..., q].

    Merging partial attentions needs the LSE, which public SDPA does not return: on CPU we call
    SDPA's flash kernel directly; elsewhere (until a GPU backend exists) plain tensor ops.
    """
    if use_cpu_kernel is None:
        use_cpu_kernel = query.device.type == "cpu"
    if use_cpu_kernel:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, False, attn_mask=bias
        )
    # Scores, softmax and LSE in fp32 whatever the model dtype; the output in the query's dtype.
    scores = torch.matmul(query.float(), key.float().transpose(-1, -2)) * query.shape[-1] ** -0.5
    if bias is not None:
        scores = scores + bias
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse[..., None]), value.float()).to(query.dtype), lse


# The fewest decode queries per kv head (rows x query heads per kv head) a group needs to go through
# the prefix kernel: measured on SmolLM2 in bf16 (4 x 400-token instructions, AVX512-BF16), groups of
# 2-4 rows (6-12 queries) made a step 6-17% slower than no groups, 8 rows (24) from 3% faster to 7%
# slower, 16 rows (48) and more 10-20% faster: one whole item of 32 queries.
PREFIX_KERNEL_MIN_QUERIES = 32
NO_GROUP = 1 << 62  # a min_rows no group reaches
# fp32 decode groups through the causal kernel (its queries over the group's shared blocks, then each
# row's own part continuing that softmax in the decode kernel) pay from 16 rows reading 200+ shared
# tokens, or 64 rows over 64 (a layer of SmolLM2 in cache: 1.26x at 16 x 400 tokens, 1.60x at 64 x
# 400, 0.92x at 8 x 400, 0.96x at 32 x 64); from memory they pay more.
CAUSAL_CASCADE_MIN_ROWS = 16
CAUSAL_CASCADE_MIN_SAVED_TOKENS = 3072


class TorchPagedAttention(AttentionBackend):
    """Pure-PyTorch paged attention; exact enough to reproduce transformers' greedy tokens in fp32.

    ``min_shared_tokens``: a group of decode rows is attended as a shared prefix only when that
    saves at least this many token reads (below it, the extra kernel calls cost more).
    ``decode_chunk_bytes``: on CPU, decode rows are gathered and attended in chunks of about this many
    bytes of K+V (`decode_chunk_rows`).
    """

    def __init__(self, min_shared_tokens: int = 256, decode_chunk_bytes: int = 16 << 20,
                 kernels: CpuKernels | None = None, batch_invariant: bool = False) -> None:
        self.min_shared_tokens = min_shared_tokens
        # No cascade attention (prefill groups, decode groups over shared prefixes): merging partial
        # softmaxes rounds differently from one pass over the whole context, so a row's bits would
        # depend on which rows shared its step. Each row then reads its whole context itself.
        self.batch_invariant = batch_invariant
        # Native decode attention for CPU caches it supports (engine/cpu_kernels); None: PyTorch only.
        self.kernels = kernels
        # Decode rows gathered per kernel call: their K+V (about this many bytes) stays in the CPU's
        # last-level cache between the gather and the kernel instead of round-tripping through DRAM.
        self.decode_chunk_bytes = decode_chunk_bytes
        # Reused gather buffers (K, V): fresh multi-MB allocations page-fault on every step, which
        # on CPU costs several times the copy itself.
        self._workspaces = [torch.empty(0), torch.empty(0)]

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> None:
        num_kv_heads, block_size, head_dim = k_cache.shape[-3:]
        rows = self.write_rows(metadata, num_kv_heads)
        if self.kernels is not None and k_cache.device.type == "cpu":
            self.kernels.store_kv(key, value, k_cache, v_cache, rows)
            return
        k_cache.view(-1, head_dim).index_copy_(0, rows, key.reshape(-1, head_dim))
        v_cache.view(-1, head_dim).index_copy_(0, rows, value.reshape(-1, head_dim))

    @staticmethod
    def write_rows(metadata: AttentionMetadata, num_kv_heads: int) -> torch.Tensor:
        """[T * kv_heads] rows of the cache viewed [blocks * kv_heads * block_size, dim] that the new
        tokens' K/V (``[T, kv_heads, dim]`` flattened) go to; computed once per step."""
        key = ("write_rows", num_kv_heads)
        if key not in metadata.step_cache:
            bs, slots = metadata.block_size, metadata.slot_mapping
            base = (slots // bs * num_kv_heads * bs + slots % bs)[:, None]
            heads = torch.arange(num_kv_heads, device=slots.device)[None, :] * bs
            metadata.step_cache[key] = (base + heads).reshape(-1)
        return metadata.step_cache[key]  # type: ignore[return-value]

    def forward(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        sliding_window: int | None = None,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if metadata.num_prefills == 0:  # a pure decode step: no output buffer to copy into
            return self._decode(query, k_cache, v_cache, metadata, sliding_window)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # contiguous: query is a view
        if metadata.num_decodes:
            out[: metadata.num_decodes] = self._decode(
                query[: metadata.num_decodes], k_cache, v_cache, metadata, sliding_window
            )
        grouped: set[int] = set()
        if sliding_window is None and metadata.num_prefills > 1 and not self.batch_invariant:
            for group in self.prefill_groups(metadata):
                out[group.token_rows] = self._prefill_group(query, k_cache, v_cache, metadata, group)
                grouped.update(group.chunks)
        for i in range(metadata.num_prefills):
            if i not in grouped:
                rows = slice(metadata.prefill_query_starts[i], metadata.prefill_query_starts[i]
                             + metadata.prefill_query_lens[i])
                self._prefill_chunk(query[rows], None if key is None else key[rows],
                                    None if value is None else value[rows], k_cache, v_cache, metadata, i,
                                    sliding_window, out[rows])
        return out

    def decode_plan(
        self, metadata: AttentionMetadata, sliding_window: int | None, num_kv_heads: int,
        for_kernel: bool = False, min_rows: int = 2, min_shared_tokens: int | None = None,
    ) -> DecodePlan:
        min_shared = self.min_shared_tokens if min_shared_tokens is None else min_shared_tokens
        key = ("decode_plan", sliding_window, min_rows, min_shared)
        if key not in metadata.step_cache:
            metadata.step_cache[key] = plan_decode(
                metadata, sliding_window, min_shared, num_kv_heads, for_kernel, min_rows
            )
        return metadata.step_cache[key]  # type: ignore[return-value]

    def plan_for_decode(self, metadata: AttentionMetadata, sliding_window: int | None, k_cache: torch.Tensor,
                        dtype: torch.dtype, group: int) -> tuple[DecodePlan, bool]:
        """This step's decode plan for queries of `dtype` (`group` query heads a kv head) and
        whether the native decode kernel runs it: the grouping rules of the path that will run."""
        use_kernel = self._uses_kernel(k_cache)
        min_rows, min_shared = self._group_rule(dtype, k_cache, group, use_kernel)
        plan = self.decode_plan(metadata, sliding_window, k_cache.shape[-3], use_kernel, min_rows, min_shared)
        return plan, use_kernel

    def _uses_kernel(self, k_cache: torch.Tensor) -> bool:
        return (self.kernels is not None and k_cache.device.type == "cpu"
                and self.kernels.supports(k_cache.dtype, k_cache.shape[-1], k_cache.shape[-2]))

    def _gather_rows(self, cache: torch.Tensor, rows: torch.Tensor, workspace: int) -> torch.Tensor:
        """Copy ``rows`` of ``cache`` viewed as [blocks * kv_heads, block_size * dim] into a reused buffer."""
        row_size = cache.shape[-2] * cache.shape[-1]
        needed = rows.numel() * row_size
        buffer = self._workspaces[workspace]
        if buffer.numel() < needed or buffer.dtype != cache.dtype or buffer.device != cache.device:
            buffer = self._workspaces[workspace] = torch.empty(needed, dtype=cache.dtype, device=cache.device)
        gathered = buffer[:needed].view(rows.numel(), row_size)
        torch.index_select(cache.view(-1, row_size), 0, rows, out=gathered)
        return gathered

    @staticmethod
    def _attend_prefixes(
        q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: PrefixBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each group's shared blocks attended once for all its rows, as one block of queries per
        group, every group of the batch in one call: (output [rows, kv_heads, group, dim], lse
        [rows, kv_heads, group]) for ``batch.rows``."""
        _, num_kv_heads, group, head_dim = q.shape
        groups, n = batch.groups, len(batch.rows) // batch.groups
        context = (groups, num_kv_heads, -1, head_dim)
        keys = gather_cache_rows(k_cache, batch.cache_rows, context)
        values = gather_cache_rows(v_cache, batch.cache_rows, context)
        # [groups * n, kvh, group, dim] -> [groups, kvh, n * group, dim]
        queries = q[batch.rows].view(groups, n, num_kv_heads, group, head_dim).transpose(1, 2)
        queries = queries.reshape(groups, num_kv_heads, n * group, head_dim)
        out, lse = attention_with_lse(queries, keys, values)
        out = out.view(groups, num_kv_heads, n, group, head_dim).transpose(1, 2)
        lse = lse.view(groups, num_kv_heads, n, group).transpose(1, 2)
        rows = groups * n
        return out.reshape(rows, num_kv_heads, group, head_dim), lse.reshape(rows, num_kv_heads, group)

    def _prefix_partials(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DecodePlan
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """(output, lse) of every row's shared prefix, shaped like ``q``; rows outside every group keep
        lse -inf, so the decode kernel starts them afresh (their output is not read)."""
        assert self.kernels is not None
        initial = (torch.empty_like(q), torch.full(q.shape[:-1], float("-inf")))
        if self._uses_prefix_kernel(q.dtype, k_cache):
            for batch in plan.prefix_batches:  # AMX, straight from the cache into the buffers
                self.kernels.prefix_attention(q, k_cache, v_cache, batch.rows, batch.block_ids, *initial)
            return initial
        if self._uses_causal_kernel(q.dtype, k_cache):
            # fp32: each group's queries over its shared blocks in one call of the causal kernel
            # (every query sees every key), K packed once for all of them.
            for batch in plan.prefix_batches:
                n = len(batch.rows) // batch.groups
                shared = batch.block_ids.shape[1] * k_cache.shape[-2]
                for g in range(batch.groups):
                    rows = batch.rows[g * n:(g + 1) * n]
                    out, lse = self.kernels.causal_attention(q[rows], k_cache, v_cache, batch.block_ids[g],
                                                             shared, keys=shared, with_lse=True)
                    initial[0][rows], initial[1][rows] = out, lse
            return initial
        for batch in plan.prefix_batches:
            shared_out, shared_lse = self._attend_prefixes(q, k_cache, v_cache, batch)
            initial[0][batch.rows], initial[1][batch.rows] = shared_out, shared_lse
        return initial

    def _decode_own_parts(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DecodePlan
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """PyTorch path: each row's own part gathered a chunk of rows at a time (the chunk's K/V still
        in the CPU's cache when the kernel reads it), then SDPA's flash kernel with its LSE."""
        assert plan.own_cache_rows is not None and plan.own_key_bias is not None
        num_rows, num_kv_heads, _, head_dim = q.shape
        context_len = plan.own_key_bias.shape[-1]
        row_bytes = 2 * num_kv_heads * context_len * head_dim * k_cache.element_size()
        step = decode_chunk_rows(q.device, row_bytes, num_rows, self.decode_chunk_bytes)
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        for first in range(0, num_rows, step):
            last = min(first + step, num_rows)
            rows = plan.own_cache_rows[first:last].reshape(-1)
            context_shape = (last - first, num_kv_heads, context_len, head_dim)
            keys = self._gather_rows(k_cache, rows, 0).view(context_shape)
            values = self._gather_rows(v_cache, rows, 1).view(context_shape)
            out[first:last], lse[first:last] = attention_with_lse(
                q[first:last], keys, values, plan.own_key_bias[first:last]
            )
        return out, lse

    def _decode(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """One query token per row. The G query heads of a kv head act as G "query positions", so
        GQA needs no repeated K/V; shared prefixes are attended per group and merged by LSE."""
        if self.batch_invariant and not self._uses_kernel(k_cache):
            return self._decode_tiled(query, k_cache, v_cache, metadata, sliding_window)
        if metadata.static_decode:
            return self._decode_static(query, k_cache, v_cache, metadata, sliding_window)
        num_rows, num_heads, head_dim = query.shape
        num_kv_heads = k_cache.shape[-3]
        group = num_heads // num_kv_heads
        plan, use_kernel = self.plan_for_decode(metadata, sliding_window, k_cache, query.dtype, group)
        q = query.view(num_rows, num_kv_heads, group, head_dim)
        if use_kernel:
            q = q.contiguous()  # once for both kernels (the query is a view into the fused QKV output)
            # Each row's own part continues the online softmax of its prefix's partial result.
            assert self.kernels is not None and plan.own_tables is not None
            assert plan.own_tokens is not None and plan.own_first is not None
            initial = self._prefix_partials(q, k_cache, v_cache, plan) if plan.prefix_batches else None
            out, _ = self.kernels.decode_attention(q, k_cache, v_cache, plan.own_tables, plan.own_tokens,
                                                   plan.own_first, initial)
            return out.reshape(num_rows, num_heads, head_dim)
        shared = [(batch.rows, *self._attend_prefixes(q, k_cache, v_cache, batch))
                  for batch in plan.prefix_batches]
        out, lse = self._decode_own_parts(q, k_cache, v_cache, plan)
        for rows, shared_out, shared_lse in shared:
            out[rows] = merge_partials(out[rows], lse[rows], shared_out, shared_lse, out.dtype)
        return out.reshape(num_rows, num_heads, head_dim)

    @staticmethod
    def _decode_tiled(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      metadata: AttentionMetadata, sliding_window: int | None) -> torch.Tensor:
        """Batch invariance without the decode kernel: fixed key tiles and row blocks
        (engine/invariant/tiled_attention.py). A fixed-shape step (a CUDA graph's) runs the tiles its
        tables' width holds, read from no device tensor; an eager one the tiles its rows need."""
        key = ("decode_tiles", sliding_window)
        if key not in metadata.step_cache:  # once per step, shared by the layers
            tables = metadata.decode_block_tables
            width = tables.shape[1] * metadata.block_size
            num_tiles = -(-width // KEY_TILE) if metadata.static_decode else None  # no host read
            num_kv_heads = k_cache.shape[-3]
            metadata.step_cache[key] = plan_tiled_decode(
                tables.to(query.device), metadata.decode_seq_lens, sliding_window, num_kv_heads,
                query.shape[1] // num_kv_heads, metadata.block_size, num_tiles)
        return decode_tiled(query, k_cache, v_cache, plan=metadata.step_cache[key])  # type: ignore[arg-type]

    @staticmethod
    def _decode_static(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       metadata: AttentionMetadata, sliding_window: int | None) -> torch.Tensor:
        """A fixed-shape decode step: every row's blocks gathered to the block tables' width and
        masked past its length on the device; no grouping (that needs the host), no host reads."""
        num_rows, num_heads, head_dim = query.shape
        num_kv_heads, block_size = k_cache.shape[-3], k_cache.shape[-2]
        tables, seq_lens = metadata.decode_block_tables, metadata.decode_seq_lens
        key = ("static_decode", sliding_window)
        if key not in metadata.step_cache:  # once per step, shared by the layers
            key_pos = torch.arange(tables.shape[1] * block_size, device=tables.device)[None, :]
            metadata.step_cache[key] = (head_major_rows(tables, num_kv_heads).reshape(-1),
                                        decode_key_bias(key_pos, seq_lens, sliding_window))
        rows, bias = metadata.step_cache[key]  # type: ignore[misc]
        context = (num_rows, num_kv_heads, tables.shape[1] * block_size, head_dim)
        q = query.view(num_rows, num_kv_heads, num_heads // num_kv_heads, head_dim)
        out, _ = attention_with_lse(q, gather_cache_rows(k_cache, rows, context),
                                    gather_cache_rows(v_cache, rows, context), bias)
        return out.reshape(num_rows, num_heads, head_dim)

    def _group_rule(self, dtype: torch.dtype, k_cache: torch.Tensor, group: int, use_kernel: bool
                    ) -> tuple[int, int | None]:
        """The fewest rows a decode group needs to be attended as a shared prefix, and the fewest
        shared token reads it must save (None: the backend's ``min_shared_tokens``). The prefix kernel
        packs a group's shared K/V, then attends it in items of 32 queries: smaller groups are cheaper
        read by the decode kernel in each row's own part. In fp32 the causal kernel attends a group
        (CAUSAL_CASCADE_MIN_ROWS; SDPA's flash call per group plus the continuation had been
        slower than no groups at all: 6-20% at 8-256 rows). Without either, the decode kernel reads
        every row's shared blocks straight from the cache, so there are no groups. The PyTorch
        path (no decode kernel) groups rows to gather the shared blocks once. Batch invariant: no
        groups at all."""
        if self.batch_invariant:
            return NO_GROUP, None
        if not use_kernel:
            return 2, None
        if self._uses_prefix_kernel(dtype, k_cache):
            return -(-PREFIX_KERNEL_MIN_QUERIES // group), None
        if self._uses_causal_kernel(dtype, k_cache):
            return CAUSAL_CASCADE_MIN_ROWS, max(self.min_shared_tokens, CAUSAL_CASCADE_MIN_SAVED_TOKENS)
        return NO_GROUP, None

    def prefill_groups(self, metadata: AttentionMetadata) -> list[PrefillGroup]:
        key = ("prefill_groups", None)
        if key not in metadata.step_cache:
            metadata.step_cache[key] = plan_prefill_groups(metadata, self.min_shared_tokens)
        return metadata.step_cache[key]  # type: ignore[return-value]

    def _prefill_group(
        self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata,
        group: PrefillGroup,
    ) -> torch.Tensor:
        """Cascade prefill: every query token of the group over the shared blocks in one call, each
        chunk over the rest of its context (causal) on its own, merged exactly by log-sum-exp.
        Returns [T, heads, dim] for ``group.token_rows``."""
        num_heads, head_dim = query.shape[1:]
        num_kv_heads, block_size = k_cache.shape[-3], k_cache.shape[-2]
        per_kv = num_heads // num_kv_heads
        if self._uses_kernel(k_cache):
            # Each query token is a row of the native kernel: its own part (causal: the tokens up to
            # its own) read through its chunk's blocks, continuing the shared part's softmax.
            assert self.kernels is not None
            tables, counts = self._own_rows(metadata, group, block_size)
            rows_q = query[group.token_rows].view(-1, num_kv_heads, per_kv, head_dim)
            initial = self._shared_part(rows_q, k_cache, v_cache, group.block_ids)
            out, _ = self.kernels.decode_attention(rows_q, k_cache, v_cache, tables, counts,
                                                   torch.zeros_like(counts), initial)
            return out.view(-1, num_heads, head_dim)
        # GQA folded into the query length: [T, heads, dim] -> [1, kvh, T * per_kv, dim].
        queries = query[group.token_rows].view(-1, num_kv_heads, per_kv, head_dim).transpose(0, 1)
        queries = queries.reshape(1, num_kv_heads, -1, head_dim)
        keys, values = self._gather_blocks(k_cache, v_cache, group.block_ids)
        shared_out, shared_lse = attention_with_lse(queries, keys, values)
        own_out, own_lse = torch.empty_like(shared_out), torch.empty_like(shared_lse)
        shared_len, row = len(group.block_ids) * block_size, 0
        for i in group.chunks:
            length, seq_len = metadata.prefill_query_lens[i], metadata.prefill_seq_lens[i]
            rows = slice(row * per_kv, (row + length) * per_kv)
            own_blocks = metadata.prefill_block_tables[i][len(group.block_ids): -(-seq_len // block_size)]
            keys, values = self._gather_blocks(k_cache, v_cache, own_blocks)
            bias = self._own_bias(metadata, i, shared_len, keys.shape[2], per_kv)
            own = attention_with_lse(queries[:, :, rows], keys, values, bias)
            own_out[:, :, rows], own_lse[:, :, rows] = own
            row += length
        merged = merge_partials(own_out, own_lse, shared_out, shared_lse, query.dtype)
        # [1, kvh, T * per_kv, dim] -> [T, heads, dim]
        merged = merged.view(num_kv_heads, -1, per_kv, head_dim).transpose(0, 1)
        return merged.reshape(-1, num_heads, head_dim)

    def _shared_part(self, rows_q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(output, lse) of every query row ``rows_q [T, kvh, per_kv, dim]`` over the shared blocks,
        in the decode kernel's layout."""
        assert self.kernels is not None
        num_kv_heads, per_kv, head_dim = rows_q.shape[1:]
        if self._uses_prefix_kernel(rows_q.dtype, k_cache):
            out, lse = torch.empty_like(rows_q), torch.empty(rows_q.shape[:-1])
            rows = torch.arange(len(rows_q))
            self.kernels.prefix_attention(rows_q, k_cache, v_cache, rows, block_ids[None], out, lse)
            return out, lse
        if self._uses_causal_kernel(rows_q.dtype, k_cache):
            # fp32: straight from the cache, every query over every shared key (no gather; SDPA's
            # flash kernel ran this at about half the causal kernel's rate)
            shared = len(block_ids) * k_cache.shape[-2]
            out, lse = self.kernels.causal_attention(rows_q, k_cache, v_cache, block_ids, shared, keys=shared,
                                                     with_lse=True)
            return out, lse
        queries = rows_q.transpose(0, 1).reshape(1, num_kv_heads, -1, head_dim)
        keys, values = self._gather_blocks(k_cache, v_cache, block_ids)
        shared_out, shared_lse = attention_with_lse(queries, keys, values)
        unfold = (num_kv_heads, -1, per_kv)
        return shared_out.view(*unfold, head_dim).transpose(0, 1), shared_lse.view(unfold).transpose(0, 1)

    @staticmethod
    def _own_rows(metadata: AttentionMetadata, group: PrefillGroup, block_size: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per query token of the group: its chunk's blocks after the shared ones ([T, W], padded
        with block 0) and how many of their tokens it sees (causal); the same for every layer."""
        key = ("own_rows", int(group.token_rows[0]))
        if key not in metadata.step_cache:
            shared = len(group.block_ids)
            width = max(-(-metadata.prefill_seq_lens[i] // block_size) - shared for i in group.chunks)
            lists = metadata.prefill_block_lists or [t.tolist() for t in metadata.prefill_block_tables]
            tables: list[list[int]] = []
            counts: list[int] = []
            for i in group.chunks:
                length, seq_len = metadata.prefill_query_lens[i], metadata.prefill_seq_lens[i]
                own = lists[i][shared: -(-seq_len // block_size)]
                tables += [own + [0] * (width - len(own))] * length
                counts += range(seq_len - length + 1 - shared * block_size, seq_len + 1 - shared * block_size)
            metadata.step_cache[key] = (torch.tensor(tables), torch.tensor(counts))
        return metadata.step_cache[key]  # type: ignore[return-value]

    @staticmethod
    def _gather_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of these blocks as [1, kvh, len(block_ids) * block_size, dim]."""
        num_kv_heads, head_dim = k_cache.shape[-3], k_cache.shape[-1]
        rows, shape = head_major_rows(block_ids, num_kv_heads).reshape(-1), (1, num_kv_heads, -1, head_dim)
        return gather_cache_rows(k_cache, rows, shape), gather_cache_rows(v_cache, rows, shape)

    @staticmethod
    def _own_bias(metadata: AttentionMetadata, index: int, shared_len: int, keys_len: int, per_kv: int
                  ) -> torch.Tensor:
        """[q_len * per_kv, keys_len] 0/-inf: a chunk's queries over its context after the shared
        blocks, causal, padding of the last block hidden; the same for every layer of the step."""
        key = (f"own_bias{index}", shared_len)
        if key not in metadata.step_cache:
            length, seq_len = metadata.prefill_query_lens[index], metadata.prefill_seq_lens[index]
            device = metadata.slot_mapping.device
            query_pos = torch.arange(seq_len - length, seq_len, device=device).repeat_interleave(per_kv)
            key_pos = shared_len + torch.arange(keys_len, device=device)
            visible = key_pos[None, :] <= query_pos[:, None]
            bias = torch.zeros(visible.shape, device=device).masked_fill_(~visible, float("-inf"))
            metadata.step_cache[key] = bias[None, None]
        return metadata.step_cache[key]  # type: ignore[return-value]

    @staticmethod
    def _context(
        k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata, index: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A prefill chunk's whole context (cached tokens + its own), read through its block table."""
        seq_len = metadata.prefill_seq_lens[index]
        blocks = metadata.prefill_block_tables[index]
        num_kv_heads, head_dim = k_cache.shape[-3], k_cache.shape[-1]
        # [blocks, kvh, block_size, dim] -> [blocks * block_size, kvh, dim]
        keys = k_cache.index_select(0, blocks).transpose(1, 2).reshape(-1, num_kv_heads, head_dim)[:seq_len]
        values = v_cache.index_select(0, blocks).transpose(1, 2).reshape(-1, num_kv_heads, head_dim)[:seq_len]
        return keys, values

    def _prefill_chunk(self, query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata, index: int,
                       sliding_window: int | None, out: torch.Tensor) -> None:
        """One prefill chunk outside a cascade group, into ``out`` (its rows of the step's output),
        by the cheapest path that applies: the prefix kernel (bf16), the causal kernel (fp32), its
        own new K/V when it has no earlier context, context + own part merged by LSE on CPU, else
        its gathered context with a mask (a sliding window, other devices)."""
        length, seq_len = metadata.prefill_query_lens[index], metadata.prefill_seq_lens[index]
        if sliding_window is not None and self.batch_invariant and self._uses_kernel(k_cache):
            self._prefill_window_rows(query, k_cache, v_cache, metadata, index, sliding_window, out)
        elif sliding_window is None and (self._uses_prefix_kernel(query.dtype, k_cache)
                                       or self._uses_causal_kernel(query.dtype, k_cache)):
            self._prefill_native(query, k_cache, v_cache, metadata, index, out)
        elif self.batch_invariant:  # no native kernel for it: fixed key tiles from key 0
            out.copy_(prefill_tiled(query, k_cache, v_cache, metadata.prefill_block_tables[index], seq_len,
                                    sliding_window))
        elif key is not None and value is not None and seq_len == length:
            out.copy_(self._prefill(query, key, value, metadata.prefill_mask(index, sliding_window)))
        elif key is not None and value is not None and sliding_window is None and query.device.type == "cpu":
            out.copy_(self._prefill_after_context(query, key, value, k_cache, v_cache, metadata, index))
        else:
            keys, values = self._context(k_cache, v_cache, metadata, index)
            out.copy_(self._prefill(query, keys, values, metadata.prefill_mask(index, sliding_window)))

    def _prefill_window_rows(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             metadata: AttentionMetadata, index: int, sliding_window: int,
                             out: torch.Tensor) -> None:
        """A sliding-window layer's prefill chunk, each query token a row of the decode kernel over
        the keys its window sees: SDPA's CPU kernel blocks keys and queries by the call's lengths, so
        a token's bits there depend on how the prompt was chunked; a decode-kernel row reads the same
        keys in the same order however it was scheduled (and as the decode steps after it do)."""
        assert self.kernels is not None
        length, seq_len = metadata.prefill_query_lens[index], metadata.prefill_seq_lens[index]
        num_heads, head_dim = query.shape[1:]
        num_kv_heads = k_cache.shape[-3]
        blocks = metadata.prefill_block_tables[index][: -(-seq_len // metadata.block_size)]
        counts = torch.arange(seq_len - length + 1, seq_len + 1)
        first = (counts - sliding_window).clamp(min=0)
        rows_q = query.reshape(length, num_kv_heads, num_heads // num_kv_heads, head_dim)
        result, _ = self.kernels.decode_attention(rows_q, k_cache, v_cache, blocks.expand(length, -1), counts,
                                                  first)
        out.copy_(result.view(length, num_heads, head_dim))

    def _uses_prefix_kernel(self, dtype: torch.dtype, k_cache: torch.Tensor) -> bool:
        return (self.kernels is not None and k_cache.device.type == "cpu"
                and self.kernels.supports_prefix_attention(dtype, k_cache.shape[-1], k_cache.shape[-2]))

    def _uses_causal_kernel(self, dtype: torch.dtype, k_cache: torch.Tensor) -> bool:
        return (self.kernels is not None and k_cache.device.type == "cpu"
                and self.kernels.supports_causal_attention(dtype, k_cache.shape[-1]))

    def _prefill_native(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        metadata: AttentionMetadata, index: int, out: torch.Tensor) -> None:
        """A prefill chunk, causal over its context and itself, in one native kernel call straight
        from the cache (its K/V are written before attention runs; no gather): each token is a row
        whose per-kv-head queries see the first ``context + position + 1`` keys. bf16: the prefix
        kernel (AMX or AVX512-BF16); fp32: the causal kernel (2-3x SDPA's flash on AVX-512). The
        queries are read where the QKV projection left them and the output written into ``out``:
        copying both took 2% of a bf16 prefill step."""
        assert self.kernels is not None
        length, seq_len = metadata.prefill_query_lens[index], metadata.prefill_seq_lens[index]
        num_heads, head_dim = query.shape[1:]
        num_kv_heads = k_cache.shape[-3]
        blocks = metadata.prefill_block_tables[index][: -(-seq_len // metadata.block_size)]
        per_kv = (length, num_kv_heads, num_heads // num_kv_heads, head_dim)
        rows_q = query.view(per_kv)
        rows_out = out.view(per_kv)
        if self._uses_causal_kernel(query.dtype, k_cache):
            self.kernels.causal_attention(rows_q, k_cache, v_cache, blocks, seq_len - length, out=rows_out)
        else:
            lse = torch.empty(rows_q.shape[:-1])
            self.kernels.prefix_attention(rows_q, k_cache, v_cache, torch.arange(length), blocks[None],
                                          rows_out, lse, causal_base=seq_len - length)

    @staticmethod
    def _prefill_after_context(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata,
                               index: int) -> torch.Tensor:
        """A chunk after cached context (chunked prefill, a prefix-cache hit): its queries over the
        context, all visible, and over its own new K/V, causal, merged exactly by log-sum-exp. Two
        mask-free calls: the CPU flash kernel skips the causal triangle's empty blocks, where one call
        with an offset mask would compute (and mask) the whole rectangle, twice the work."""
        length, seq_len = metadata.prefill_query_lens[index], metadata.prefill_seq_lens[index]
        context_len, block_size = seq_len - length, metadata.block_size
        blocks = metadata.prefill_block_tables[index][: -(-context_len // block_size)]
        keys, values = TorchPagedAttention._gather_blocks(k_cache, v_cache, blocks)
        queries = query.transpose(0, 1)[None]
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        context_out, context_lse = flash(queries, keys[:, :, :context_len], values[:, :, :context_len],
                                         0.0, False)[:2]
        own_out, own_lse = flash(queries, key.transpose(0, 1)[None], value.transpose(0, 1)[None],
                                 0.0, True)[:2]
        merged = merge_partials(own_out, own_lse, context_out, context_lse, query.dtype)
        return merged[0].transpose(0, 1)

    @staticmethod
    def _prefill(
        query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """query [q_len, heads, dim] over keys/values [seq_len, kv_heads, dim]; GQA in the kernel."""
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1)[None],
            keys.transpose(0, 1)[None],
            values.transpose(0, 1)[None],
            attn_mask=mask,
            is_causal=mask is None,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)
