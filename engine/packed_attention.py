"""Packed batches: sequences laid end to end (no padding), attention computed per sequence.

Every projection, norm and MLP of a model runs over all of a batch's tokens at once, with no
padding. Attention runs per sequence. Where the native kernels are built (engine/cpu_kernels:
fp32 anywhere, bf16 on AMX or AVX512-BF16), one call attends every sequence of the batch, reading
Q/K/V where the projection wrote them: nothing is padded or copied. Elsewhere (and for
sliding-window layers) PyTorch's SDPA runs in few calls: a batch is sorted longest first, and runs of
sequences whose lengths are within ``BUCKET_RATIO`` of the run's longest share one
``scaled_dot_product_attention`` call, padded to that longest inside the call only (the padded keys
masked out). Measured on a 2-core AVX-512/AMX machine (all-MiniLM-L6-v2's shapes, 4k-16k token
batches): one call per distinct length was 1.1-5x slower than these buckets (per-call overhead
dominates at head_dim 32, more so in bf16), and one padded call for the whole batch was no faster
than buckets at 0.7 while it wastes more attention FLOPs on batches with a wide spread of lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from bulkinfer.engine.attention import AttentionBackend
from bulkinfer.engine.cpu_kernels import CpuKernels

# A bucket's shortest sequence is at least this fraction of its longest: attention pads at most
# 1 / 0.7 of a bucket's real keys, and attention is a small share of a layer's FLOPs.
BUCKET_RATIO = 0.7


@dataclass(frozen=True)
class AttentionBucket:
    """Sequences [first_token, end_token) of a packed batch attended in one call, as ``count``
    rows padded to ``length``; ``rows``: each real token's row in the padded layout (None: all
    the same length, no padding); ``key_mask``: [count, 1, 1, length], False at padding."""

    first_token: int
    end_token: int
    count: int
    length: int
    rows: torch.Tensor | None
    key_mask: torch.Tensor | None


@dataclass(frozen=True)
class PackedBatch:
    """Sequences laid end to end, longest first: ``lengths`` in order, ``buckets`` how attention
    runs over them."""

    input_ids: torch.Tensor  # [tokens]
    positions: torch.Tensor  # [tokens], each sequence from 0
    lengths: tuple[int, ...]
    buckets: tuple[AttentionBucket, ...]
    starts: torch.Tensor  # [sequences + 1] int64: sequence s is tokens starts[s]:starts[s + 1]

    @staticmethod
    def build(sequences: list[list[int]], bucket_ratio: float = BUCKET_RATIO) -> PackedBatch:
        lengths = tuple(len(s) for s in sequences)
        if not lengths or any(a < b for a, b in zip(lengths, lengths[1:], strict=False)):
            raise ValueError("a packed batch holds one or more sequences, longest first")
        ids = torch.tensor([t for s in sequences for t in s], dtype=torch.long)
        positions = torch.cat([torch.arange(n) for n in lengths])
        starts = torch.zeros(len(lengths) + 1, dtype=torch.long)
        torch.cumsum(torch.tensor(lengths), 0, out=starts[1:])
        return PackedBatch(ids, positions, lengths, _buckets(lengths, bucket_ratio), starts)

    # What a decoder model's forward reads from its attention metadata: no decodes, one prefill
    # per sequence, nothing cached.
    num_decodes = 0
    static_decode = False
    static_step = False
    fixed_shape = False

    @property
    def num_prefills(self) -> int:
        return len(self.lengths)


def _buckets(lengths: tuple[int, ...], ratio: float) -> tuple[AttentionBucket, ...]:
    buckets = []
    first_seq, first_token, token = 0, 0, 0
    for index in range(len(lengths) + 1):
        if index == len(lengths) or lengths[index] < ratio * lengths[first_seq]:
            members = lengths[first_seq:index]
            longest, count = members[0], len(members)
            rows = mask = None
            if members[-1] != longest:
                sizes = torch.tensor(members)
                rows = torch.cat([torch.arange(n) + i * longest for i, n in enumerate(members)])
                mask = (torch.arange(longest)[None, :] < sizes[:, None]).view(count, 1, 1, longest)
            buckets.append(AttentionBucket(first_token, token, count, longest, rows, mask))
            first_seq, first_token = index, token
        if index < len(lengths):
            token += lengths[index]
    return tuple(buckets)


def _sliding_mask(length: int, window: int) -> torch.Tensor:
    """[length, length] bool: causal, each query seeing its last ``window`` keys (itself included)."""
    rows = torch.arange(length)[:, None]
    cols = torch.arange(length)[None, :]
    return (cols <= rows) & (cols > rows - window)


def _padded(x: torch.Tensor, bucket: AttentionBucket, heads: int, head_dim: int) -> torch.Tensor:
    """Rows of ``bucket`` as [count, heads, length, head_dim], zero-padded where needed."""
    rows = x[bucket.first_token:bucket.end_token].reshape(-1, heads * head_dim)
    if bucket.rows is not None:
        padded = rows.new_zeros(bucket.count * bucket.length, heads * head_dim)
        rows = padded.index_copy_(0, bucket.rows, rows)
    return rows.view(bucket.count, bucket.length, heads, head_dim).transpose(1, 2)


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: PackedBatch,
                     num_heads: int, causal: bool = False, sliding_window: int | None = None,
                     kernels: CpuKernels | None = None) -> torch.Tensor:
    """Attention of each sequence over itself. q: [tokens, heads * head_dim] (or [tokens, heads,
    head_dim]); k/v may have fewer heads (grouped-query attention). Returns q's shape. With
    ``kernels`` (engine/cpu_kernels) that run this dtype and head size, in one native call."""
    tokens = q.shape[0]
    head_dim = q[0].numel() // num_heads
    kv_heads = k[0].numel() // head_dim
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    windowed = sliding_window is not None and max(batch.lengths) > sliding_window
    if (kernels is not None and q.device.type == "cpu" and not windowed
            and kernels.supports_packed_attention(q.dtype, head_dim)):
        groups = num_heads // kv_heads
        grouped = (tokens, kv_heads, groups, head_dim)
        kernels.packed_attention(q.view(grouped), k.view(tokens, kv_heads, head_dim),
                                 v.view(tokens, kv_heads, head_dim), batch.starts, causal, out.view(grouped))
        return out
    flat_out = out.view(tokens, num_heads * head_dim)
    for bucket in batch.buckets:
        qs = _padded(q, bucket, num_heads, head_dim)
        ks = _padded(k, bucket, kv_heads, head_dim)
        vs = _padded(v, bucket, kv_heads, head_dim)
        mask = None
        if causal and sliding_window is not None and bucket.length > sliding_window:
            mask = _sliding_mask(bucket.length, sliding_window).to(q.device)
        elif not causal and bucket.key_mask is not None:
            mask = bucket.key_mask.to(q.device)
        # Causal: a real query's keys all sit before it, so padding (at the end) is never seen.
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=causal and mask is None,
                                           enable_gqa=kv_heads != num_heads)
        o = o.transpose(1, 2).reshape(bucket.count * bucket.length, num_heads * head_dim)
        if bucket.rows is not None:
            o = o.index_select(0, bucket.rows.to(q.device))
        flat_out[bucket.first_token:bucket.end_token] = o
    return out


class PackedCausalBackend(AttentionBackend):
    """Our decoder models' attention over a PackedBatch (passed as their metadata): causal per
    sequence, from the step's own keys and values. No KV cache: an embedding pass has no next step."""

    def __init__(self, kernels: CpuKernels | None = None) -> None:
        self.kernels = kernels

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 metadata: object) -> None:
        return None

    def forward(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: object,
                sliding_window: int | None = None, key: torch.Tensor | None = None,
                value: torch.Tensor | None = None) -> torch.Tensor:
        assert isinstance(metadata, PackedBatch) and key is not None and value is not None
        return packed_attention(query, key, value, metadata, query.shape[1], causal=True,
                                sliding_window=sliding_window, kernels=self.kernels)
