"""A step's image rows: for each prompt chunk that covers image tokens, the flat batch positions
those tokens take and the encoder rows that go there. Images the encoder cache lacks are encoded
together, in one batch across the step's rows, and cached."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from bulkinfer.engine.multimodal.encoder_cache import EncoderCache
from bulkinfer.engine.multimodal.inputs import MultiModalItem


@dataclass(frozen=True)
class ImageChunk:
    """Prompt positions [start, end) of a request computed from flat batch position `flat_start`."""

    items: tuple[MultiModalItem, ...]
    start: int
    end: int
    flat_start: int


@dataclass(frozen=True)
class StepImageEmbeds:
    """Rows `embeds` replace the token embeddings at flat positions `flat_index`."""

    flat_index: torch.Tensor
    embeds: torch.Tensor


class ImageEncoder(Protocol):
    """A vision-language model, as the step sees it: its encoder rows for some images."""

    def embed_images(self, items: Sequence[MultiModalItem], device: torch.device) -> torch.Tensor: ...


def step_image_embeds(chunks: Sequence[ImageChunk], model: ImageEncoder, cache: EncoderCache,
                      device: torch.device) -> StepImageEmbeds | None:
    pieces: list[tuple[np.ndarray, MultiModalItem, np.ndarray]] = []
    first_uses = 0  # images a request reaches for the first time in this step
    for chunk in chunks:
        for item in chunk.items:
            positions, rows = item.embed_rows(chunk.start, chunk.end)
            if len(positions):
                pieces.append((positions - chunk.start + chunk.flat_start, item, rows))
                first_uses += chunk.start <= item.offset
    if not pieces:
        return None
    encoded: dict[str, torch.Tensor] = {}
    missing: dict[str, MultiModalItem] = {}
    for _, item, _ in pieces:
        if item.digest in encoded or item.digest in missing:
            continue
        cached = cache.get(item.digest)
        if cached is None:
            missing[item.digest] = item
        else:
            encoded[item.digest] = cached
    cache.count(hits=max(first_uses - len(missing), 0), misses=len(missing))
    encoded.update(encode_images(list(missing.values()), model, device))
    for digest in missing:
        cache.put(digest, encoded[digest])
    flat = np.concatenate([positions for positions, _, _ in pieces])
    embeds = torch.cat([encoded[item.digest][torch.from_numpy(rows).to(device)] for _, item, rows in pieces])
    return StepImageEmbeds(torch.from_numpy(flat).to(device), embeds)


def encode_images(items: Sequence[MultiModalItem], model: ImageEncoder,
                  device: torch.device) -> dict[str, torch.Tensor]:
    """Each item's encoder rows: the model encodes them together (`embed_images`)."""
    if not items:
        return {}
    rows = model.embed_images(items, device)
    out: dict[str, torch.Tensor] = {}
    start = 0
    for item in items:
        out[item.digest] = rows[start:start + item.num_embeds].clone()  # cached alone, not as a view
        start += item.num_embeds
    assert start == len(rows), f"the encoder gave {len(rows)} rows for images of {start}"
    return out
