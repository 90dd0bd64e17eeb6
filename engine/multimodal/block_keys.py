"""Image digests in prefix-cache block hashes: an image's tokens are the same placeholder ids
whatever the picture, so each block holding part of an image's span is keyed by that image too.
Two rows with the same image and instruction share their prefix; different images never do."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from bulkinfer.engine.multimodal.inputs import MultiModalItem


def image_block_keys(items: Sequence[MultiModalItem], block_size: int) -> Callable[[int], tuple[str, ...]]:
    """block index -> the keys of the images whose spans overlap that block."""

    def keys(index: int) -> tuple[str, ...]:
        start, end = index * block_size, (index + 1) * block_size
        return tuple(f"image:{item.digest}" for item in items if item.offset < end and item.end > start)

    return keys
