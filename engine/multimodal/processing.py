"""A prompt and its images to a `MultiModalPrompt`: each image's placeholder token (one per image, in
order, as the chat template wrote it) replaced by the family processor's span."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from PIL import Image

from bulkinfer.engine.multimodal.images import ImageError, ImageLike, image_digest, load_image
from bulkinfer.engine.multimodal.inputs import MultiModalItem, MultiModalPrompt, ProcessedImage
from bulkinfer.engine.multimodal.mrope import rope_positions

DETAILS = ("auto", "low", "high")  # OpenAI's image_url detail levels


class ImageProcessorFamily(Protocol):
    """One model family's image preprocessing (engine/models/<family>_processing.py)."""

    placeholder_token_id: int  # the token the chat template writes for an image
    placeholder_text: str  # its text, for a prompt written by hand

    def process(self, image: Image.Image, detail: str) -> ProcessedImage: ...

    def variant(self, detail: str) -> str:
        """How `detail` changes the encoder's input ('' where it does not): part of the cache key."""
        ...

    def span_bounds(self) -> tuple[int, int]:
        """The tokens an image's span takes with `detail: "low"`, and at most (for estimates)."""
        ...


def expand_prompt(token_ids: Sequence[int], images: Sequence[ImageLike], family: ImageProcessorFamily,
                  details: Sequence[str | None] | None = None,
                  max_pixels: int | None = None) -> MultiModalPrompt:
    """Raises ImageError naming the image (by its place in the prompt) and the problem."""
    places = [i for i, token in enumerate(token_ids) if token == family.placeholder_token_id]
    if len(places) != len(images):
        raise ImageError(f"the prompt has {len(places)} image placeholder(s) ({family.placeholder_text}) but "
                         f"{len(images)} image(s) were given")
    details = list(details) if details is not None else [None] * len(images)
    out: list[int] = []
    items: list[MultiModalItem] = []
    previous = 0
    for index, (place, image, detail) in enumerate(zip(places, images, details, strict=True)):
        level = detail or "auto"
        if level not in DETAILS:
            raise ImageError(f"image {index}: detail must be one of {', '.join(DETAILS)}, not {detail!r}")
        try:
            decoded = load_image(image) if max_pixels is None else load_image(image, max_pixels)
        except ImageError as error:
            raise ImageError(f"image {index}: {error}") from None
        processed = family.process(decoded, level)
        out.extend(token_ids[previous:place])
        variant = family.variant(level)
        items.append(MultiModalItem(
            digest=image_digest(decoded) + (f":{variant}" if variant else ""),
            pixel_values=processed.pixel_values, num_embeds=processed.num_embeds,
            offset=len(out), length=len(processed.span_token_ids), is_embed=processed.is_embed,
            grid=processed.grid))
        out.extend(processed.span_token_ids)
        previous = place + 1
    out.extend(token_ids[previous:])
    if not any(item.grid is not None for item in items):
        return MultiModalPrompt(out, tuple(items))
    positions, delta = rope_positions(len(out), items)
    return MultiModalPrompt(out, tuple(items), positions, delta)
