"""A chat row's images for the engine: fetched and decoded within the job's limits and location rules
(worker/images/), then expanded into the model's prompt span by its family's processor (the engine's
`expand_prompt`, run here on the shard's thread so image work stays off the engine's loop). Any
problem is the row's `invalid_image` error."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from bulkinfer.engine.multimodal.images import ImageError
from bulkinfer.engine.multimodal.inputs import MultiModalPrompt
from bulkinfer.engine.multimodal.processing import ImageProcessorFamily, expand_prompt
from bulkinfer.jobs.formats.image_parts import iter_image_parts
from bulkinfer.jobs.formats.rows import RowErrorCode
from bulkinfer.worker.images.fetcher import ImageFetcher, ImageRejected, RowImage


class ImageRowRejected(ValueError):
    code = RowErrorCode.INVALID_IMAGE


def has_images(messages: Sequence[Mapping[str, Any]] | None) -> bool:
    return bool(messages) and next(iter_image_parts(messages), None) is not None  # type: ignore[arg-type]


# Rows whose images are read at once: reads wait on the store or the network, not the CPU.
FETCH_THREADS = 8

Fetched = list[RowImage] | ImageRowRejected


def fetch_rows_images(messages: Mapping[int, Sequence[Mapping[str, Any]] | None],
                      fetcher: ImageFetcher | None) -> dict[int, Fetched]:
    """Each row's images (by its position), read FETCH_THREADS rows at a time; a row whose image
    cannot be used gets its rejection instead."""
    if fetcher is None or not messages:
        return {}

    def fetch(row_messages: Sequence[Mapping[str, Any]]) -> Fetched:
        try:
            return fetcher.fetch(row_messages)
        except ImageRejected as rejected:
            return ImageRowRejected(str(rejected))

    positions = list(messages)
    with ThreadPoolExecutor(min(FETCH_THREADS, len(positions)), thread_name_prefix="images") as pool:
        return dict(zip(positions, pool.map(fetch, [messages[p] for p in positions]), strict=True))


def image_prompt(token_ids: list[int], fetched: Fetched | None, family: ImageProcessorFamily | None,
                 model: str) -> MultiModalPrompt:
    """The rendered prompt with its images (`fetch_rows_images`) expanded; raises ImageRowRejected
    naming the problem."""
    if family is None:
        raise ImageRowRejected(no_images_message(model))
    if fetched is None:
        raise ImageRowRejected("this run reads no images (no image fetcher was set up for it)")
    if isinstance(fetched, ImageRowRejected):
        raise fetched
    images = fetched
    try:
        return expand_prompt(token_ids, [image.image for image in images], family,
                             [image.detail for image in images])
    except ImageError as error:
        raise ImageRowRejected(str(error)) from None


def no_images_message(model: str) -> str:
    named = f"the model {model}" if model else "this model"
    return (f"{named} takes no images (a text-only model); serve a vision-language model "
            "(Qwen2.5-VL, Idefics3 / SmolVLM) for rows with images")
