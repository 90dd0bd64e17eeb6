"""Qwen2.5-VL images: transformers' own Qwen2-VL image processor from the checkpoint's
`preprocessor_config.json` (resized to multiples of patch x merge within min/max pixels, cut into
patches of 2 x 14 x 14 x 3 values), and the span Qwen2.5-VL's processor writes: its `<|image_pad|>`
repeated once per merged patch (the template writes `<|vision_start|><|image_pad|><|vision_end|>`).
`detail: "low"` caps the picture at LOW_DETAIL_PIXELS."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from bulkinfer.engine.multimodal.inputs import ProcessedImage

IMAGE_PAD_TOKEN = "<|image_pad|>"
LOW_DETAIL_PIXELS = 448 * 448


class QwenImageProcessing:
    placeholder_text = IMAGE_PAD_TOKEN

    def __init__(self, model_dir: str | Path, image_token_id: int, merge_size: int) -> None:
        from transformers import Qwen2VLImageProcessorPil  # torchvision-free; the same numbers

        self._processor = Qwen2VLImageProcessorPil.from_pretrained(str(model_dir))
        self.placeholder_token_id = image_token_id
        self.merge_size = merge_size

    def variant(self, detail: str) -> str:
        return "low" if detail == "low" else ""

    def span_bounds(self) -> tuple[int, int]:
        unit = (self._processor.patch_size * self.merge_size) ** 2
        most = int(self._processor.size["longest_edge"]) // unit
        return min(LOW_DETAIL_PIXELS // unit, most), most

    def process(self, image: Image.Image, detail: str) -> ProcessedImage:
        options: dict[str, Any] = {}
        if detail == "low":
            most = min(LOW_DETAIL_PIXELS, int(self._processor.size["longest_edge"]))
            least = int(self._processor.size["shortest_edge"])
            options["size"] = {"shortest_edge": least, "longest_edge": most}
        encoded = self._processor(images=[image], return_tensors="np", **options)
        t, h, w = (int(value) for value in encoded["image_grid_thw"][0])
        rows, columns = h // self.merge_size, w // self.merge_size
        count = t * rows * columns
        pixels = torch.from_numpy(np.ascontiguousarray(encoded["pixel_values"]))
        assert t == 1, "an image is one frame"
        return ProcessedImage(pixels, [self.placeholder_token_id] * count, None, count, grid=(rows, columns))
