"""M-RoPE (Qwen2.5-VL): rotary positions in three parts (time, height, width). A text token's three
parts are equal: its position. An image's tokens take (p, p + row, p + column) for the grid after the
encoder's merge, p being the position the image starts at, and the text after it continues from
p + max(rows, columns): so a request's positions run behind its token index by `delta` (negative),
which stays the same for every token it generates.

Only the image tokens need the three parts apart. The engine keeps the one-part rotary everywhere
else, with positions shifted to the first part (`shifted_positions`), and overrides the image rows'
cos/sin (`StepRopeRows`): decode steps, the native decode path and the KV layout are unchanged."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from bulkinfer.engine.multimodal.inputs import MultiModalItem


def rope_positions(num_tokens: int, items: Sequence[MultiModalItem]) -> tuple[np.ndarray, int]:
    """[3, num_tokens] positions of a prompt whose images are `items` (each with a grid), and the
    shift of the positions after it."""
    positions = np.empty((3, num_tokens), dtype=np.int64)
    next_position = 0
    start = 0
    for item in sorted(items, key=lambda item: item.offset):
        assert item.grid is not None, "an M-RoPE image needs its grid"
        positions[:, start:item.offset] = np.arange(item.offset - start) + next_position
        next_position += item.offset - start
        rows, columns = item.grid
        assert rows * columns == item.length, (item.grid, item.length)
        positions[0, item.offset:item.end] = next_position
        positions[1, item.offset:item.end] = np.repeat(np.arange(rows), columns) + next_position
        positions[2, item.offset:item.end] = np.tile(np.arange(columns), rows) + next_position
        next_position += max(rows, columns)
        start = item.end
    positions[:, start:] = np.arange(num_tokens - start) + next_position
    delta = int(positions.max()) + 1 - num_tokens if num_tokens else 0
    return positions, delta


@dataclass(frozen=True)
class StepRopeRows:
    """Flat batch rows whose rotary takes three parts, and their [3, rows] positions."""

    flat_index: torch.Tensor
    positions: torch.Tensor


def mrope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, sections: Sequence[int],
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [rows, 1, head_dim / 2] of [3, rows] positions: frequency j takes the part its
    section says (transformers' `mrope_section`, cycled over t, h, w)."""
    freqs = positions[..., None].float() * inv_freq.to(positions.device)  # [3, rows, dim/2]
    parts = torch.split(freqs, list(sections), dim=-1)
    chosen = torch.cat([part[i % 3] for i, part in enumerate(parts)], dim=-1)
    return chosen.cos().to(dtype)[:, None, :], chosen.sin().to(dtype)[:, None, :]
