"""How big the images of a row may be, and how many: one deployment-wide set of bounds.

The readers apply the per-row count and the size of inline bytes as they build rows (that row's
`invalid_image` error); the worker's image fetcher applies them all as it reads and decodes
(worker/images/). `Settings.image_limits()` reads them from the `image_*` settings.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_IMAGE_MAX_BYTES = 20 << 20  # 20 MiB, OpenAI's limit per image
DEFAULT_IMAGE_MAX_PIXELS = 40_000_000
DEFAULT_IMAGES_PER_ROW = 16


@dataclass(frozen=True, slots=True)
class ImageLimits:
    max_bytes: int = DEFAULT_IMAGE_MAX_BYTES  # an image's encoded bytes (a file, a data: URL's payload)
    max_pixels: int = DEFAULT_IMAGE_MAX_PIXELS  # width x height, read from the header before decoding
    max_images_per_row: int = DEFAULT_IMAGES_PER_ROW
    # Hosts http(s):// image URLs may name (a `host` or `host:port` entry); none by default, so a
    # worker fetches nothing from the network unless the deployment says where.
    allowed_http_hosts: tuple[str, ...] = ()


def parse_http_hosts(setting: str | None) -> tuple[str, ...]:
    """`image_http_hosts` (comma-separated `host` or `host:port`) as lower-case entries."""
    return tuple(dict.fromkeys(host.strip().lower() for host in (setting or "").split(",") if host.strip()))
