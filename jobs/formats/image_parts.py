"""Images in a row: OpenAI chat `image_url` content parts, the one form every reader produces.

    {"type": "image_url", "image_url": {"url": "<data: URL | s3:// | path | http(s)://>",
                                        "detail": "auto" | "low" | "high"}}   (detail optional)

OpenAI lines and messages columns carry them already (a bare `"image_url": "<url>"` is put in the
object form); Anthropic image blocks and `image_column` cells are turned into them. Shapes are checked
as rows are read (a malformed part is the row's `invalid_row` error naming the field); what the url
points at is read and decoded by the worker (worker/images/).
"""

from __future__ import annotations

import base64
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

from bulkinfer.jobs.image_limits import ImageLimits
from bulkinfer.jobs.image_locations import (
    ImageSource,
    base64_decoded_size,
    data_url_payload,
    describe_url,
    image_source,
    image_url_problem,
)

IMAGE_PART_TYPE = "image_url"
DETAILS = ("auto", "low", "high")
BYTES_MIME = "application/octet-stream"  # a Parquet binary cell says nothing of its format: Pillow sniffs it


class ImagePartError(ValueError):
    """A row's image that cannot run; `code` is the row's error code (`invalid_row` for a malformed
    part, `invalid_image` for an image that is not one, too big or too many)."""

    def __init__(self, code: Literal["invalid_row", "invalid_image"], message: str) -> None:
        super().__init__(message)
        self.code = code


def image_part(url: str, detail: str | None = None) -> dict[str, Any]:
    image_url: dict[str, Any] = {"url": url}
    if detail is not None:
        image_url["detail"] = detail
    return {"type": IMAGE_PART_TYPE, "image_url": image_url}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def is_image_part(part: Any) -> bool:
    return isinstance(part, Mapping) and part.get("type") == IMAGE_PART_TYPE


def checked_content(role: Any, content: Any, where: str, limits: ImageLimits) -> Any:
    """A message's content with each `image_url` part checked and in the object form; other parts,
    and content that is not a list, as they are."""
    if not isinstance(content, list) or not any(is_image_part(part) for part in content):
        return content
    if role != "user":
        position = next(index for index, part in enumerate(content) if is_image_part(part))
        raise ImagePartError("invalid_row", f"{where}[{position}] is an image: only user messages may hold "
                                            "images")
    return [_checked_part(part, f"{where}[{position}]", limits) if is_image_part(part) else part
            for position, part in enumerate(content)]


def _checked_part(part: Mapping[str, Any], where: str, limits: ImageLimits) -> dict[str, Any]:
    value = part.get("image_url")
    url: Any
    if isinstance(value, str):
        url, detail = value, None
    elif isinstance(value, Mapping):
        url, detail = value.get("url"), value.get("detail")
        if not isinstance(url, str):
            raise ImagePartError("invalid_row", f"{where}.image_url.url must be a string")
        if detail is not None and detail not in DETAILS:
            raise ImagePartError("invalid_row",
                                 f"{where}.image_url.detail must be one of {', '.join(DETAILS)}")
    else:
        raise ImagePartError("invalid_row", f"{where}.image_url must be an object ({{url, detail}}) or a URL "
                                            "string")
    return image_part(checked_url(url, f"{where}.image_url.url", limits), detail)


def checked_url(url: str, where: str, limits: ImageLimits) -> str:
    """`url` when it is a form the worker reads (and an inline image within the byte limit)."""
    problem = image_url_problem(url)
    if problem is not None:
        raise ImagePartError("invalid_image", f"{where}: {problem}")
    if image_source(url) == ImageSource.DATA:
        size = base64_decoded_size(data_url_payload(url))
        if size > limits.max_bytes:
            raise ImagePartError("invalid_image", f"{where}: {describe_url(url)} holds {size:,} bytes, over "
                                                  f"the limit of {limits.max_bytes:,} an image may have")
    return url


def check_image_count(messages: Sequence[Mapping[str, Any]], limits: ImageLimits) -> None:
    count = sum(1 for _ in iter_image_parts(messages))
    if count > limits.max_images_per_row:
        raise ImagePartError("invalid_image", f"the row gives {count} images, over the limit of "
                                              f"{limits.max_images_per_row} per row (image_max_per_row)")


def iter_image_parts(messages: Sequence[Mapping[str, Any]]) -> Iterator[tuple[str, Any, Any]]:
    """(where, url, detail) of each image part in order, where being `messages[i].content[j]`; url
    and detail as the part gives them (checked when the row was read)."""
    for index, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list):
            continue
        for position, part in enumerate(content):
            if not is_image_part(part):
                continue
            value = part.get("image_url")
            if isinstance(value, Mapping):
                yield f"messages[{index}].content[{position}]", value.get("url"), value.get("detail")
            else:
                yield f"messages[{index}].content[{position}]", value, None


def cell_image_parts(value: Any, where: str, limits: ImageLimits) -> list[dict[str, Any]]:
    """The image parts of an `image_column` cell: bytes, a location or data: URL, a Hugging Face
    `datasets` image (`{"bytes": ..., "path": ...}`: its bytes, else its path as a location), or a list
    of those; null or empty: none (a text-only row). Any other value is the row's `invalid_image` error."""
    if _is_empty_hf_image(value):
        value = None
    if value is None or (isinstance(value, str | bytes | list | tuple) and len(value) == 0):
        return []
    many = isinstance(value, list | tuple)
    items = [item for item in value if not _is_empty_hf_image(item)] if many else [value]
    if len(items) > limits.max_images_per_row:
        raise ImagePartError("invalid_image", f"{where} holds {len(items)} images, over the limit of "
                                              f"{limits.max_images_per_row} per row (image_max_per_row)")
    return [image_part(_cell_url(item, f"{where}[{position}]" if many else where, limits))
            for position, item in enumerate(items)]


HF_IMAGE_FIELDS = frozenset({"bytes", "path"})  # how `datasets.Image` stores a picture in Parquet


def _is_hf_image(item: Any) -> bool:
    return isinstance(item, Mapping) and bool(item) and set(item) <= HF_IMAGE_FIELDS


def _is_empty_hf_image(item: Any) -> bool:
    """`datasets` writes a missing picture as a struct of two nulls."""
    return _is_hf_image(item) and item.get("bytes") is None and not item.get("path")


def _cell_url(item: Any, where: str, limits: ImageLimits) -> str:
    if _is_hf_image(item):
        item = item["bytes"] if item.get("bytes") is not None else item["path"]
    if isinstance(item, bytes | bytearray | memoryview):
        size = len(item) if not isinstance(item, memoryview) else item.nbytes
        if size > limits.max_bytes:
            raise ImagePartError("invalid_image", f"{where} holds {size:,} bytes, over the limit of "
                                                  f"{limits.max_bytes:,} an image may have")
        return f"data:{BYTES_MIME};base64,{base64.b64encode(item).decode('ascii')}"
    if isinstance(item, str) and item:
        return checked_url(item, where, limits)
    described = "an empty string" if isinstance(item, str) else f"a value of type {type(item).__name__}"
    raise ImagePartError("invalid_image", f"{where} holds {described}: an image is bytes, a location or "
                                          "data: URL, a {bytes, path} image struct, or a list of those")
