"""An image's bytes, read with a bound: a `data:` URL decoded, an object read by one ranged GET of at
most `max_bytes + 1` bytes, an http(s) body streamed until it passes the bound."""

from __future__ import annotations

import base64
import binascii

import httpx
from botocore.exceptions import ClientError

from bulkinfer.jobs.image_limits import ImageLimits
from bulkinfer.jobs.image_locations import base64_decoded_size, data_url_payload
from bulkinfer.jobs.object_store.base import ObjectNotFound, ObjectStore
from bulkinfer.worker.images.problems import ImageProblem, over_the_byte_limit

# S3 answers that are about this object, not the store being down: the row's error, not a retry.
DENIED_CODES = frozenset({"AccessDenied", "403", "NoSuchBucket", "AllAccessDisabled", "InvalidObjectState"})


def read_data_url(url: str, limits: ImageLimits) -> bytes:
    payload = data_url_payload(url)
    size = base64_decoded_size(payload)
    if size > limits.max_bytes:  # known from the text's length: nothing is decoded
        raise over_the_byte_limit(size, limits.max_bytes)
    try:
        return base64.b64decode("".join(payload.split()), validate=True)
    except binascii.Error as error:
        raise ImageProblem(f"the data: URL is not valid base64 ({error})") from None


def read_store(store: ObjectStore, key: str, url: str, limits: ImageLimits) -> bytes:
    """The object's bytes; a missing or forbidden object is the image's problem, while a store that is
    down raises as it is (the task retries)."""
    try:
        data = store.read_range(key, 0, limits.max_bytes + 1)
    except ObjectNotFound:
        raise ImageProblem(f"image {url} not found") from None
    except PermissionError as error:
        raise ImageProblem(f"image {url} cannot be read ({error.strerror})") from None
    except ClientError as error:
        code = str(error.response.get("Error", {}).get("Code", ""))
        if code not in DENIED_CODES:
            raise
        raise ImageProblem(f"image {url} cannot be read ({code})") from None
    if len(data) > limits.max_bytes:
        raise over_the_byte_limit(_size(store, key), limits.max_bytes)
    return data


def _size(store: ObjectStore, key: str) -> int | None:
    """The object's size for the message (None if it cannot be had)."""
    try:
        return store.head(key).size
    except Exception:  # noqa: BLE001 - only the message needs it
        return None


def read_http(client: httpx.Client, url: str, limits: ImageLimits) -> bytes:
    """The body of a GET of `url` (no redirects: one could lead to a host not allowed)."""
    try:
        with client.stream("GET", url, headers={"Accept-Encoding": "identity"}) as response:
            if response.status_code != 200:
                redirect = " (redirects are not followed)" if response.is_redirect else ""
                raise ImageProblem(f"image {url} answered HTTP {response.status_code}{redirect}")
            declared = response.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > limits.max_bytes:
                raise over_the_byte_limit(int(declared), limits.max_bytes)
            chunks: list[bytes] = []
            received = 0
            for chunk in response.iter_bytes():
                received += len(chunk)
                if received > limits.max_bytes:
                    raise over_the_byte_limit(None, limits.max_bytes)
                chunks.append(chunk)
    except httpx.HTTPError as error:
        raise ImageProblem(f"image {url} could not be fetched ({type(error).__name__}: {error})") from None
    return b"".join(chunks)
