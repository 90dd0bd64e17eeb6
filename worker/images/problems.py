"""`ImageProblem`: what is wrong with one image, before the fetcher says which part it was."""

from __future__ import annotations


class ImageProblem(Exception):
    """One image cannot be used; the message says why (the fetcher adds where it is)."""


def over_the_byte_limit(size: int | None, limit: int) -> ImageProblem:
    """`size`: the image's bytes where known; None: only that it has more than `limit`."""
    if size is None:
        return ImageProblem(f"image is more than {limit:,} bytes, over the limit of {limit:,}")
    return ImageProblem(f"image is {size:,} bytes, over the limit of {limit:,}")
