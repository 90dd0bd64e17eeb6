"""Bytes to a decoded RGB image, within the pixel bound: the size is read from the header
(`PIL.Image.open` is lazy) and checked before any pixel is decoded; a photo's EXIF orientation is
applied."""

from __future__ import annotations

import io

import PIL.Image

from bulkinfer.engine.multimodal.images import upright
from bulkinfer.jobs.image_limits import ImageLimits
from bulkinfer.worker.images.problems import ImageProblem

# The formats a row's image may have (OpenAI's and Anthropic's, and BMP). Pillow opens more, some by
# running other programs (EPS through Ghostscript): none of those for bytes anyone may send.
FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP")
UNREADABLE = ("not an image Pillow can read (cannot identify image file); the formats read here are "
              f"{', '.join(FORMATS[:-1])} and {FORMATS[-1]}")


def decode_image(data: bytes, limits: ImageLimits) -> PIL.Image.Image:
    """The image `data` holds, converted to RGB and fully loaded; `ImageProblem` when it is none
    Pillow reads, or has more pixels than `limits` (or Pillow's decompression-bomb bound) allow."""
    try:
        image = PIL.Image.open(io.BytesIO(data), formats=FORMATS)
    except (PIL.Image.DecompressionBombError, PIL.Image.DecompressionBombWarning) as error:
        # Over twice Pillow's MAX_IMAGE_PIXELS (or over it, where a process made the warning an error).
        raise ImageProblem(f"image is too large to decode safely ({error})") from None
    except PIL.UnidentifiedImageError:
        raise ImageProblem(UNREADABLE) from None
    except MemoryError:
        raise
    except Exception as error:  # noqa: BLE001 - a plugin may raise anything on bytes it cannot parse
        raise ImageProblem(f"not an image Pillow can read ({_reason(error)})") from None
    with image:
        _check_pixels(image, limits)
        try:
            image.load()
            return upright(image).convert("RGB")
        except MemoryError:
            raise
        except Exception as error:  # noqa: BLE001 - truncated or corrupt pixel data, in any plugin
            raise ImageProblem(f"not an image Pillow can read ({_reason(error)})") from None


def _check_pixels(image: PIL.Image.Image, limits: ImageLimits) -> None:
    width, height = image.size
    if width * height > limits.max_pixels:
        raise ImageProblem(f"image is {width}x{height} pixels, over the limit of {limits.max_pixels:,}")
    # Pillow only warns between its bound and twice it; a deployment's own bound above Pillow's
    # still stops there, without touching the process-wide warning filters (task threads share them).
    bomb = PIL.Image.MAX_IMAGE_PIXELS
    if bomb is not None and width * height > bomb:
        raise ImageProblem(f"image is {width}x{height} pixels, over Pillow's decompression-bomb limit of "
                           f"{bomb:,}")


def _reason(error: Exception) -> str:
    return str(error)[:200] or type(error).__name__
