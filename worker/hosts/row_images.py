"""A chat row's images for the engine: fetched and decoded within the job's limits and location rules
(worker/images/), then expanded into the model's prompt span by its family's processor (the engine's
`expand_prompt`, run here on the shard's thread so image work stays off the engine's loop). Any
problem is the row's `invalid_image` error."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from bulkinfer.engine.multimodal.images import ImageError
from bulkinfer.engine.multimodal.inputs import MultiModalPrompt
from bulkinfer.engine.multimodal.processing import ImageProcessorFamily, expand_prompt
from bulkinfer.jobs.formats.image_parts import iter_image_parts
from bulkinfer.jobs.formats.rows import RowErrorCode
from bulkinfer.worker.images.fetcher import ImageFetcher, ImageRejected


class ImageRowRejected(ValueError):
    code = RowErrorCode.INVALID_IMAGE


def has_images(messages: Sequence[Mapping[str, Any]] | None) -> bool:
    return bool(messages) and next(iter_image_parts(messages), None) is not None  # type: ignore[arg-type]


def image_prompt(token_ids: list[int], messages: Sequence[Mapping[str, Any]],
                 family: ImageProcessorFamily | None, fetcher: ImageFetcher | None,
                 model: str) -> MultiModalPrompt:
    """The rendered prompt's images read and expanded; raises ImageRowRejected naming the problem."""
    if family is None:
        raise ImageRowRejected(no_images_message(model))
    if fetcher is None:
        raise ImageRowRejected("this run reads no images (no image fetcher was set up for it)")
    try:
        images = fetcher.fetch(messages)
    except ImageRejected as rejected:
        raise ImageRowRejected(str(rejected)) from None
    try:
        return expand_prompt(token_ids, [image.image for image in images], family,
                             [image.detail for image in images])
    except ImageError as error:
        raise ImageRowRejected(str(error)) from None


def no_images_message(model: str) -> str:
    named = f"the model {model}" if model else "this model"
    return (f"{named} takes no images (a text-only model); serve a vision-language model "
            "(Idefics3 / SmolVLM) for rows with images")
