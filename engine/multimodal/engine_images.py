"""The engine's image side for a model that takes images: its family's processor and the encoder
cache shared by the scheduler (which counts uncached images' encoder work in a step's token budget)
and the model runner (which fills it)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bulkinfer.engine.multimodal.encoder_cache import EncoderCache
from bulkinfer.engine.multimodal.families import image_family
from bulkinfer.engine.multimodal.images import ImageError, ImageLike
from bulkinfer.engine.multimodal.inputs import MultiModalPrompt
from bulkinfer.engine.multimodal.processing import ImageProcessorFamily, expand_prompt

# Encoder rows kept (each a decoder-width vector: 576 floats for SmolVLM-256M, 2.3 KB in fp32).
DEFAULT_ENCODER_CACHE_ROWS = 65_536


class ImageInputs:
    def __init__(self, family: ImageProcessorFamily, cache_rows: int = DEFAULT_ENCODER_CACHE_ROWS) -> None:
        self.family = family
        self.cache = EncoderCache(cache_rows)

    @staticmethod
    def for_model(model_dir: str | Path, tokenizer: Any) -> ImageInputs | None:
        """None for a text-only model."""
        family = image_family(model_dir, tokenizer)
        return None if family is None else ImageInputs(family)

    def prompt(self, token_ids: Sequence[int], images: Sequence[ImageLike],
               details: Sequence[str | None] | None = None) -> MultiModalPrompt:
        """The prompt with its images expanded; raises ImageError. Safe from any thread."""
        return expand_prompt(token_ids, images, self.family, details)


def no_images(model_dir: str | Path) -> ImageError:
    return ImageError(f"the model {Path(model_dir).name} takes no images (a text-only model)")
