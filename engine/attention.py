"""Paged attention over the flattened batch.

KV cache per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (index 0 = K, 1 = V).
New K/V rows are written through the slot mapping (``block_id * block_size + offset``); attention
then reads each request's context through its block table, so a request only ever sees its own
blocks (shared prefix blocks included).

The runner orders the flattened batch as: decode requests first (one query token each), then
prefill chunks (several query tokens each). Decodes run as one batched computation; prefill chunks
run one fused SDPA call each — there are few per step (the token budget bounds them) and each is
large, so the per-request call overhead is negligible next to its own work.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Where each request's tokens and KV blocks are, for one step."""

    block_size: int
    slot_mapping: torch.Tensor  # [T] int64: cache slot of every new token
    # Decode requests: rows [0, num_decodes) of the batch, one token each.
    num_decodes: int
    decode_seq_lens: torch.Tensor  # [num_decodes] context length including the new token
    decode_block_tables: torch.Tensor  # [num_decodes, max_decode_blocks], padded with block 0
    # Prefill chunks follow the decodes; plain lists because they are iterated in Python.
    prefill_query_starts: list[int] = field(default_factory=list)
    prefill_query_lens: list[int] = field(default_factory=list)
    prefill_seq_lens: list[int] = field(default_factory=list)
    prefill_block_tables: list[torch.Tensor] = field(default_factory=list)
    # Masks depend only on the step (and the layer's sliding window), so layers share them.
    _mask_cache: dict[tuple[str, int | None], object] = field(default_factory=dict, repr=False)

    @property
    def num_prefills(self) -> int:
        return len(self.prefill_query_lens)

    def decode_key_mask(self, sliding_window: int | None) -> torch.Tensor:
        """[num_decodes, 1, max_ctx] True where the key may be attended to."""
        key = ("decode", sliding_window)
        if key not in self._mask_cache:
            max_ctx = self.decode_block_tables.shape[1] * self.block_size
            key_pos = torch.arange(max_ctx)[None, :]
            seq_lens = self.decode_seq_lens[:, None]
            valid = key_pos < seq_lens
            if sliding_window is not None:
                # transformers' rule: key visible iff key_pos > query_pos - window (query_pos = seq_len - 1).
                valid &= key_pos > seq_lens - 1 - sliding_window
            self._mask_cache[key] = valid[:, None, :]
        return self._mask_cache[key]  # type: ignore[return-value]

    def prefill_mask(self, index: int, sliding_window: int | None) -> torch.Tensor | None:
        """[q_len, seq_len] causal-with-offset mask, or None when plain causal applies."""
        query_len, seq_len = self.prefill_query_lens[index], self.prefill_seq_lens[index]
        if query_len == seq_len and (sliding_window is None or seq_len <= sliding_window):
            return None
        key = (f"prefill{index}", sliding_window)
        if key not in self._mask_cache:
            query_pos = torch.arange(seq_len - query_len, seq_len)[:, None]
            key_pos = torch.arange(seq_len)[None, :]
            valid = key_pos <= query_pos
            if sliding_window is not None:
                valid &= key_pos > query_pos - sliding_window
            self._mask_cache[key] = valid
        return self._mask_cache[key]  # type: ignore[return-value]


class AttentionBackend(ABC):
    """Writes new K/V into the paged cache and attends over each request's context."""

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
    ) -> torch.Tensor:
        """query ``[T, heads, head_dim]`` -> attention output ``[T, heads, head_dim]``."""


class TorchPagedAttention(AttentionBackend):
    """Pure-PyTorch paged attention; exact enough to reproduce transformers' greedy tokens in fp32."""

    def __init__(self) -> None:
        # Reused gather buffer: fresh multi-MB allocations page-fault on every step, which on CPU
        # costs several times the copy itself.
        self._workspace = torch.empty(0)

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> None:
        num_kv_heads, head_dim = k_cache.shape[-2:]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, key)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, value)

    def forward(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        out = torch.empty_like(query)
        if metadata.num_decodes:
            out[: metadata.num_decodes] = self._decode(
                query[: metadata.num_decodes], k_cache, v_cache, metadata, sliding_window
            )
        for i in range(metadata.num_prefills):
            start, length = metadata.prefill_query_starts[i], metadata.prefill_query_lens[i]
            out[start : start + length] = self._prefill(
                query[start : start + length], k_cache, v_cache, metadata, i, sliding_window
            )
        return out

    def _gather(self, cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
        """Copy the blocks of ``block_table`` ([R, B]) into the workspace: [R, B * block_size, kvh, dim]."""
        rows, blocks = block_table.shape
        block_numel = cache[0].numel()
        needed = rows * blocks * block_numel
        if self._workspace.numel() < needed or self._workspace.dtype != cache.dtype:
            self._workspace = torch.empty(needed, dtype=cache.dtype, device=cache.device)
        gathered = self._workspace[:needed].view(rows * blocks, *cache.shape[1:])
        torch.index_select(cache, 0, block_table.reshape(-1), out=gathered)
        return gathered.view(rows, blocks * cache.shape[1], *cache.shape[2:])

    def _decode(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """One query token per request, all requests in two batched matmuls.

        The gathered context is ``[R, L, kvh * dim]`` (contiguous per request); the query is laid
        out block-diagonally (``[R, heads, kvh * dim]``, zero outside its own kv head) so that one
        bmm gives every head's scores with GQA and no strided copies. The zeros cost kvh x more
        multiply-adds, which is cheap next to the memory-bound gather.
        """
        num_reqs, num_heads, head_dim = query.shape
        num_kv_heads = k_cache.shape[-2]
        group = num_heads // num_kv_heads
        eye = torch.eye(num_kv_heads, dtype=query.dtype, device=query.device)
        q = query.view(num_reqs, num_kv_heads, group, 1, head_dim) * eye.view(
            1, num_kv_heads, 1, num_kv_heads, 1
        )
        q = q.view(num_reqs, num_heads, num_kv_heads * head_dim)

        keys = self._gather(k_cache, metadata.decode_block_tables)
        max_ctx = keys.shape[1]
        scores = torch.bmm(q, keys.view(num_reqs, max_ctx, -1).transpose(1, 2))
        scores.mul_(1.0 / math.sqrt(head_dim))
        scores.masked_fill_(~metadata.decode_key_mask(sliding_window), float("-inf"))
        probs = torch.softmax(scores, dim=-1)

        values = self._gather(v_cache, metadata.decode_block_tables)
        mixed = torch.bmm(probs, values.view(num_reqs, max_ctx, -1))
        mixed = mixed.view(num_reqs, num_kv_heads, group, num_kv_heads, head_dim)
        # Keep each head's own kv-head block: diagonal over the two kv-head axes.
        own = torch.diagonal(mixed, dim1=1, dim2=3)  # [R, group, dim, kvh]
        return own.permute(0, 3, 1, 2).reshape(num_reqs, num_heads, head_dim)

    def _prefill(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        index: int,
        sliding_window: int | None,
    ) -> torch.Tensor:
        seq_len = metadata.prefill_seq_lens[index]
        blocks = metadata.prefill_block_tables[index]
        num_kv_heads, head_dim = k_cache.shape[-2:]
        keys = k_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:seq_len]
        values = v_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:seq_len]
        mask = metadata.prefill_mask(index, sliding_window)
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1)[None],
            keys.transpose(0, 1)[None],
            values.transpose(0, 1)[None],
            attn_mask=mask,
            is_causal=mask is None,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)
