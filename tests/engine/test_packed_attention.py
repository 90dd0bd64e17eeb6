"""Attention over packed sequences: each sequence sees itself only, whether it shares a padded
bucket with others or not."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bulkinfer.engine.packed_attention import PackedBatch, packed_attention


@pytest.mark.parametrize("causal", [False, True])
def test_each_sequence_attends_to_itself_alone(causal: bool) -> None:
    torch.manual_seed(0)
    lengths = [10, 10, 8, 7, 3, 1]  # buckets: 10/10/8/7 padded to 10, then 3, then 1
    batch = PackedBatch.build([[0] * n for n in lengths])
    assert [b.count for b in batch.buckets] == [4, 1, 1]
    assert batch.buckets[0].key_mask is not None and batch.buckets[1].key_mask is None
    heads, kv_heads, dim = 4, 2, 8
    q = torch.randn(sum(lengths), heads, dim)
    k, v = torch.randn(sum(lengths), kv_heads, dim), torch.randn(sum(lengths), kv_heads, dim)
    out = packed_attention(q, k, v, batch, heads, causal=causal)
    start = 0
    for n in lengths:
        rows = slice(start, start + n)
        alone = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1), k[rows].transpose(0, 1).repeat_interleave(2, 0),
            v[rows].transpose(0, 1).repeat_interleave(2, 0), is_causal=causal).transpose(0, 1)
        torch.testing.assert_close(out[rows], alone, atol=1e-5, rtol=1e-5)
        start += n


def test_sliding_window_attention_sees_only_the_window() -> None:
    torch.manual_seed(0)
    lengths = [9, 9, 4]
    batch = PackedBatch.build([[0] * n for n in lengths])
    heads, kv_heads, dim = 4, 2, 8
    q = torch.randn(sum(lengths), heads, dim)
    k, v = torch.randn(sum(lengths), kv_heads, dim), torch.randn(sum(lengths), kv_heads, dim)
    out = packed_attention(q, k, v, batch, heads, causal=True, sliding_window=3)
    start = 0
    for n in lengths:
        for t in range(n):
            keys = range(max(0, t - 2), t + 1)  # itself and the two before it
            for h in range(heads):
                kv = h // (heads // kv_heads)
                scores = torch.stack([q[start + t, h] @ k[start + j, kv] for j in keys]) / dim ** 0.5
                expected = (scores.softmax(0)[:, None] * torch.stack([v[start + j, kv] for j in keys])).sum(0)
                torch.testing.assert_close(out[start + t, h], expected, atol=1e-5, rtol=1e-5)
        start += n
