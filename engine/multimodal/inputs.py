"""What a prompt's images become: items the engine carries with the request.

An image's placeholder in the prompt (one token, as the chat template writes it) is expanded into
the model's own token span (`offset`, `length`); the span's positions marked in `is_embed` take the
image encoder's output rows, in order, in place of their token embeddings (Idefics3 spans mix text
tokens such as `<row_1_col_2>` with image tokens; a Qwen2.5-VL span is all image tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(frozen=True, eq=False)
class MultiModalItem:
    """One image of one prompt, ready for the encoder."""

    digest: str  # the image's content hash and how it was processed: the encoder cache's key
    pixel_values: torch.Tensor  # the family's encoder input ([tiles, 3, S, S] for Idefics3)
    num_embeds: int  # rows the encoder gives for it
    offset: int  # its span's first prompt position
    length: int  # its span's length in tokens
    # Which span positions take an encoder row (in order); None: every one.
    is_embed: np.ndarray | None = field(default=None, repr=False)
    # Its rows as a grid (rows, columns) after the encoder's merge, for M-RoPE (Qwen2.5-VL); None: none.
    grid: tuple[int, int] | None = None

    @property
    def end(self) -> int:
        return self.offset + self.length

    def embed_rows(self, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """For the prompt positions [start, end) (clipped to the span): the positions that take an
        encoder row, and which rows."""
        lo, hi = max(start, self.offset), min(end, self.end)
        if lo >= hi:
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
        if self.is_embed is None:
            positions = np.arange(lo, hi, dtype=np.int64)
            return positions, positions - self.offset
        mask = self.is_embed[lo - self.offset:hi - self.offset]
        before = int(np.count_nonzero(self.is_embed[:lo - self.offset]))
        positions = np.flatnonzero(mask).astype(np.int64) + lo
        return positions, np.arange(before, before + len(positions), dtype=np.int64)


@dataclass(frozen=True)
class ProcessedImage:
    """A family processor's output for one image: its encoder input, its prompt span's tokens."""

    pixel_values: torch.Tensor
    span_token_ids: list[int]
    is_embed: np.ndarray | None  # over the span; None: every position
    num_embeds: int
    grid: tuple[int, int] | None = None  # M-RoPE: the rows' grid (MultiModalItem.grid)


@dataclass(frozen=True)
class MultiModalPrompt:
    """A prompt with its images expanded: what `LLMEngine.add_request` takes. Built by
    `LLMEngine.process_prompt` (any thread: image processing is kept off the engine's loop)."""

    token_ids: list[int]
    items: tuple[MultiModalItem, ...]
    # M-RoPE (Qwen2.5-VL): each prompt position's (t, h, w) rotary positions, and the shift of the
    # positions after the prompt (engine/multimodal/mrope.py); None: positions are the token index.
    rope_positions: np.ndarray | None = field(default=None, repr=False)
    rope_delta: int = 0

    @property
    def num_image_tokens(self) -> int:
        """Prompt positions the images take (what usage counts for them)."""
        return sum(item.length for item in self.items)


NO_IMAGES = MultiModalPrompt([], ())  # what a text prompt carries of images: nothing
