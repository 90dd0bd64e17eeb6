"""Packed batches: sequences laid end to end (no padding), attention computed per sequence.

Every projection, norm and MLP of a model runs over all of a batch's tokens at once; attention runs
per sequence, and sequences of the same length (a batch is sorted longest first, so they sit
together) share one ``scaled_dot_product_attention`` call. No token sees another sequence, and no
FLOP is spent on padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention import AttentionBackend


@dataclass(frozen=True)
class PackedBatch:
    """Sequences laid end to end, longest first: ``lengths`` in order, ``groups`` the runs of equal
    length as (first token, number of sequences, length)."""

    input_ids: torch.Tensor  # [tokens]
    positions: torch.Tensor  # [tokens], each sequence from 0
    lengths: tuple[int, ...]
    groups: tuple[tuple[int, int, int], ...]

    @staticmethod
    def build(sequences: list[list[int]]) -> PackedBatch:
        lengths = tuple(len(s) for s in sequences)
        if not lengths or any(a < b for a, b in zip(lengths, lengths[1:], strict=False)):
            raise ValueError("a packed batch holds one or more sequences, longest first")
        ids = torch.tensor([t for s in sequences for t in s], dtype=torch.long)
        positions = torch.cat([torch.arange(n) for n in lengths])
        groups: list[tuple[int, int, int]] = []
        start = 0
        for n in lengths:
            if groups and groups[-1][2] == n:
                first, count, _ = groups[-1]
                groups[-1] = (first, count + 1, n)
            else:
                groups.append((start, 1, n))
            start += n
        return PackedBatch(ids, positions, lengths, tuple(groups))

    # What a decoder model's forward reads from its attention metadata: no decodes, one prefill
    # per sequence, nothing cached.
    num_decodes = 0
    static_decode = False

    @property
    def num_prefills(self) -> int:
        return len(self.lengths)


def _sliding_mask(length: int, window: int) -> torch.Tensor:
    """[length, length] bool: causal, each query seeing its last ``window`` keys (itself included)."""
    rows = torch.arange(length)[:, None]
    cols = torch.arange(length)[None, :]
    return (cols <= rows) & (cols > rows - window)


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: PackedBatch,
                     num_heads: int, causal: bool = False, sliding_window: int | None = None) -> torch.Tensor:
    """Attention of each sequence over itself. q: [tokens, heads * head_dim] (or [tokens, heads,
    head_dim]); k/v may have fewer heads (grouped-query attention). Returns q's shape."""
    tokens = q.shape[0]
    head_dim = q[0].numel() // num_heads
    kv_heads = k[0].numel() // head_dim
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    flat_out = out.view(tokens, num_heads * head_dim)
    for first, count, length in batch.groups:
        rows = slice(first, first + count * length)
        qs = q[rows].reshape(count, length, num_heads, head_dim).transpose(1, 2)
        ks = k[rows].reshape(count, length, kv_heads, head_dim).transpose(1, 2)
        vs = v[rows].reshape(count, length, kv_heads, head_dim).transpose(1, 2)
        if causal and sliding_window is not None and length > sliding_window:
            mask = _sliding_mask(length, sliding_window).to(q.device)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=kv_heads != num_heads)
        else:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, enable_gqa=kv_heads != num_heads)
        flat_out[rows] = o.transpose(1, 2).reshape(count * length, num_heads * head_dim)
    return out


class PackedCausalBackend(AttentionBackend):
    """Our decoder models' attention over a PackedBatch (passed as their metadata): causal per
    sequence, from the step's own keys and values. No KV cache: an embedding pass has no next step."""

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 metadata: object) -> None:
        return None

    def forward(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: object,
                sliding_window: int | None = None, key: torch.Tensor | None = None,
                value: torch.Tensor | None = None) -> torch.Tensor:
        assert isinstance(metadata, PackedBatch) and key is not None and value is not None
        return packed_attention(query, key, value, metadata, query.shape[1], causal=True,
                                sliding_window=sliding_window)
