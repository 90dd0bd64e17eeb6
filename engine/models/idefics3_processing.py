"""Idefics3 / SmolVLM images: transformers' own image processor from the checkpoint's
`preprocessor_config.json` (resize, split into tiles of the tower's size plus a global view,
normalize), and the prompt span Idefics3's processor writes for the tiles:

    <fake_token_around_image><row_1_col_1><image>*n ... <fake_token_around_image><row_1_col_k><image>*n\\n
    ... \\n<fake_token_around_image><global-img><image>*n<fake_token_around_image>

The span starts and ends with a special token, so its tokens are the same alone as in any prompt:
each (rows, cols) layout is tokenized once. `detail: "low"` skips the tiles (the global view alone).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from bulkinfer.engine.multimodal.inputs import ProcessedImage

FAKE_IMAGE_TOKEN = "<fake_token_around_image>"
IMAGE_TOKEN = "<image>"
GLOBAL_IMAGE_TOKEN = "<global-img>"


class Idefics3ImageProcessing:
    """Thread-safe: the tokenizer is used under a lock, the image processor is stateless."""

    placeholder_text = IMAGE_TOKEN

    def __init__(self, model_dir: str | Path, tokenizer: Any, image_token_id: int, image_size: int,
                 patch_size: int, scale_factor: int) -> None:
        from transformers import Idefics3ImageProcessorPil  # torchvision-free; the same numbers

        # Any: transformers types __call__ as BaseImageProcessor's, without Idefics3's own options
        self._processor: Any = Idefics3ImageProcessorPil.from_pretrained(str(model_dir))
        tile = int(self._processor.max_image_size["longest_edge"])
        if tile != image_size:
            raise ValueError(f"{model_dir}: preprocessor max_image_size {tile} differs from the vision "
                             f"tower's image_size {image_size}")
        self._tokenizer = tokenizer
        self._lock = threading.Lock()
        self.placeholder_token_id = image_token_id
        self.seq_len = (image_size // patch_size) ** 2 // scale_factor ** 2
        self._spans: dict[tuple[int, int], tuple[list[int], np.ndarray]] = {}

    def variant(self, detail: str) -> str:
        return "low" if detail == "low" else ""

    def span_bounds(self) -> tuple[int, int]:
        """The global view alone; and the most tiles a resized image can split into, plus it."""
        longest, tile = self._processor.size["longest_edge"], self._processor.max_image_size["longest_edge"]
        per_side = -(-int(longest) // int(tile))
        return len(self._span(0, 0)[0]), len(self._span(per_side, per_side)[0])

    def process(self, image: Image.Image, detail: str) -> ProcessedImage:
        encoded = self._processor(images=[[image]], do_image_splitting=detail != "low",
                                  return_row_col_info=True, return_tensors="np")
        pixels = torch.from_numpy(np.ascontiguousarray(encoded["pixel_values"][0]))
        rows, cols = int(encoded["rows"][0][0]), int(encoded["cols"][0][0])
        span, is_embed = self._span(rows, cols)
        tiles = pixels.shape[0]
        assert tiles == rows * cols + 1 or (rows == cols == 0 and tiles == 1), (rows, cols, tiles)
        return ProcessedImage(pixels, span, is_embed, tiles * self.seq_len)

    def _span(self, rows: int, cols: int) -> tuple[list[int], np.ndarray]:
        with self._lock:
            if (rows, cols) not in self._spans:
                text = span_text(rows, cols, self.seq_len)
                ids = list(self._tokenizer.encode(text, add_special_tokens=False))
                self._spans[(rows, cols)] = (ids, np.array(ids) == self.placeholder_token_id)
            return self._spans[(rows, cols)]


def span_text(rows: int, cols: int, seq_len: int) -> str:
    """What Idefics3's processor writes for an image of rows x cols tiles (0 x 0: the global view alone)."""
    images = IMAGE_TOKEN * seq_len
    global_view = f"{FAKE_IMAGE_TOKEN}{GLOBAL_IMAGE_TOKEN}{images}{FAKE_IMAGE_TOKEN}"
    if rows == 0 and cols == 0:
        return global_view
    grid = "".join("".join(f"{FAKE_IMAGE_TOKEN}<row_{r + 1}_col_{c + 1}>{images}" for c in range(cols)) + "\n"
                   for r in range(rows))
    return f"{grid}\n{global_view}"
