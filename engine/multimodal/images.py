"""Images as the engine takes them: a PIL image, encoded bytes, a local path or a `data:` URL,
decoded to RGB, and a content hash over the decoded pixels (the same picture hashes the same
whichever way it arrived)."""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from pathlib import Path
from typing import Any

from PIL import Image, ImageOps, UnidentifiedImageError

# An image is either decoded already or something to decode.
ImageLike = Any  # PIL.Image.Image | bytes | str (path or data: URL) | pathlib.Path

DEFAULT_MAX_PIXELS = 40_000_000  # also what decompression-bomb checks stop at


class ImageError(ValueError):
    """An image the engine cannot use; the message says which and why."""


def load_image(image: ImageLike, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """`image` decoded, fully loaded, in RGB; raises ImageError."""
    if isinstance(image, Image.Image):
        return _rgb(image, max_pixels)
    if isinstance(image, (bytes, bytearray, memoryview)):
        return _decode(bytes(image), "the image bytes", max_pixels)
    if isinstance(image, str) and image.startswith("data:"):
        return _decode(data_url_bytes(image), "the data: URL", max_pixels)
    if isinstance(image, str) and "://" in image and not image.startswith("file://"):
        raise ImageError(f"image {image[:100]}: the engine reads images from data: URLs and local files "
                         "(a bulkinfer job's worker fetches s3:// and http(s) ones)")
    if isinstance(image, (str, Path)):
        path = Path(str(image).removeprefix("file://"))
        if not path.is_file():
            raise ImageError(f"image file {path} not found")
        return _decode(path.read_bytes(), str(path), max_pixels)
    raise ImageError("an image must be a PIL image, bytes, a path or a data: URL, "
                     f"not {type(image).__name__}")


def data_url_bytes(url: str) -> bytes:
    """The bytes of a base64 `data:` URL; raises ImageError."""
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise ImageError("a data: URL image must be base64 (data:<type>;base64,<data>)")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the data: URL's base64 is not valid") from None


def _decode(data: bytes, what: str, max_pixels: int) -> Image.Image:
    try:
        opened = Image.open(io.BytesIO(data))
    except (UnidentifiedImageError, OSError) as error:
        raise ImageError(f"{what} is not an image Pillow can read ({error})") from None
    return _rgb(opened, max_pixels, what)


def _rgb(image: Image.Image, max_pixels: int, what: str = "the image") -> Image.Image:
    width, height = image.size
    if width * height > max_pixels:
        raise ImageError(f"{what} is {width}x{height} pixels, over the limit of {max_pixels:,}")
    if width == 0 or height == 0:
        raise ImageError(f"{what} is empty ({width}x{height} pixels)")
    try:
        image.load()
        image = upright(image)
        return image if image.mode == "RGB" else image.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as error:
        raise ImageError(f"{what} cannot be decoded ({error})") from None


EXIF_ORIENTATION = 0x0112


def upright(image: Image.Image) -> Image.Image:
    """The picture as the camera meant it: a photo's EXIF orientation applied (as browsers and
    transformers' `load_image` do), so a phone's portrait shot is not read lying on its side; a new
    image where it turns, `image` itself where it has no orientation to apply."""
    if image.getexif().get(EXIF_ORIENTATION, 1) in (1, None):
        return image
    return ImageOps.exif_transpose(image)


def image_digest(image: Image.Image) -> str:
    """sha256 over the RGB pixels and the size: the image's content, however it was encoded."""
    digest = hashlib.sha256(f"{image.mode}:{image.width}x{image.height}:".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()
