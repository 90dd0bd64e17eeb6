"""Rows of the paged KV cache ``[blocks, kv_heads, block_size, dim]`` viewed as
``[blocks * kv_heads, block_size * dim]``: which rows hold a sequence's blocks head by head, and one
gather of them into a contiguous tensor. Shared by the attention backend and the fixed-shape tiled
attention (engine/invariant/)."""

from __future__ import annotations

import torch


def head_major_rows(block_ids: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Rows of a cache viewed [blocks * kv_heads, block_size * dim] holding these blocks, ordered
    (head, block): ``block_ids [..., k]`` -> ``[..., kv_heads, k]``. Gathered, they are K (or V) in
    the attention kernels' [kv_heads, k * block_size, dim] layout, with no transposing copy."""
    heads = torch.arange(num_kv_heads, device=block_ids.device)[:, None]
    return block_ids.unsqueeze(-2) * num_kv_heads + heads


def gather_cache_rows(cache: torch.Tensor, rows: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``rows`` (see head_major_rows) of ``cache [blocks, kv_heads, block_size, dim]``, as ``shape``."""
    return cache.view(-1, cache.shape[-2] * cache.shape[-1]).index_select(0, rows).view(shape)
