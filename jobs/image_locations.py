"""The forms an image's `url` may take in a row, told apart without reading anything.

- `data:<mime>;base64,<payload>`: the bytes inline;
- a store location, as `input_uri` takes it: `s3://bucket/key`, `file:///abs/path` or `/abs/path`
  (read by the worker under the `input_uri` rules: jobs/storage_rules.py);
- `http://` or `https://`: fetched by the worker, only from the hosts the deployment's
  `image_http_hosts` setting lists.
"""

from __future__ import annotations

import re
from enum import StrEnum

from bulkinfer.jobs.object_store.factory import split_uri

DATA_PREFIX = "data:"
BASE64_MARK = ";base64"
_HTTP = re.compile(r"^https?://[^/?#\s]+", re.IGNORECASE)
SHOWN_CHARS = 120
FORMS = ("a data: URL (data:<type>;base64,...), s3://bucket/key, an absolute path or file:// URL, or an "
         "http(s):// URL")


class ImageSource(StrEnum):
    DATA = "data"
    STORE = "store"
    HTTP = "http"


def image_source(url: str) -> ImageSource | None:
    """The form of `url`, or None when it is none this server reads."""
    if url.startswith(DATA_PREFIX):
        header, comma, _ = url.partition(",")
        return ImageSource.DATA if comma and header.lower().endswith(BASE64_MARK) else None
    if _HTTP.match(url):
        return ImageSource.HTTP
    try:
        _, _, key = split_uri(url)
    except ValueError:
        return None
    return ImageSource.STORE if key and not key.endswith("/") else None


def image_url_problem(url: str) -> str | None:
    """Why `url` is no image location this server reads (None: it is one)."""
    if image_source(url) is not None:
        return None
    if url.startswith(DATA_PREFIX):
        return "a data: URL must carry base64 bytes (data:<type>;base64,...)"
    return f"{describe_url(url)} is not an image location this server reads; give {FORMS}"


def describe_url(url: str) -> str:
    """`url` as a message shows it: a data: URL by its header and length, anything else cut short."""
    if url.startswith(DATA_PREFIX):
        return f"{url.partition(',')[0][:SHOWN_CHARS]},... ({len(url):,} characters)"
    return url if len(url) <= SHOWN_CHARS else f"{url[:SHOWN_CHARS]}..."


def data_url_payload(url: str) -> str:
    """The base64 text of a data: URL (`image_source` said DATA)."""
    return url.partition(",")[2]


def base64_decoded_size(text: str) -> int:
    """The bytes `text` decodes to, without decoding it (whitespace ignored, as the decoder does)."""
    length = len(text) - sum(text.count(space) for space in " \t\r\n")
    padding = len(text.rstrip(" \t\r\n")) - len(text.rstrip(" \t\r\n").rstrip("="))
    return max(0, length * 3 // 4 - padding)
