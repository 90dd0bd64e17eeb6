"""`ImageFetcher`: a row's images, read within the limits and the job's location rules, decoded."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
import PIL.Image

from bulkinfer.jobs.formats.image_parts import DETAILS, iter_image_parts
from bulkinfer.jobs.image_limits import ImageLimits
from bulkinfer.jobs.image_locations import ImageSource, image_source, image_url_problem
from bulkinfer.jobs.image_rules import MayRead
from bulkinfer.worker.images.decode import decode_image
from bulkinfer.worker.images.problems import ImageProblem
from bulkinfer.worker.images.reads import read_data_url, read_http, read_store
from bulkinfer.worker.images.stores import OpenStore

DEFAULT_HTTP_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class RowImage:
    image: PIL.Image.Image  # RGB, fully loaded
    detail: str | None = None  # the part's `detail` (auto, low, high), if it gave one


class ImageRejected(Exception):
    """A row's image that cannot be used: `where` names the part (`messages[1].content[0]`, or `the
    row`), `problem` says what is wrong. That row's `invalid_image` error."""

    def __init__(self, where: str, problem: str) -> None:
        super().__init__(f"{where}: {problem}")
        self.where = where
        self.problem = problem


class ImageFetcher:
    """Reads and decodes the images of a row's messages.

    `open_store(uri)`: the (store, key) of an `s3://` or local location (`StoreOpener`).
    `may_read(uri)`: why the job may not read a store location, or None (`image_read_rule`: the
    tenant rules of input_uri); None: every location is readable (`bulkinfer run`).
    `http_client`: an httpx client to use (default: one of the fetcher's own, made on the first
    http(s) image of an allowed host, with `http_timeout_s`, closed by `close()`).
    """

    def __init__(self, open_store: OpenStore, limits: ImageLimits | None = None, *,
                 may_read: MayRead | None = None, http_client: httpx.Client | None = None,
                 http_timeout_s: float = DEFAULT_HTTP_TIMEOUT_S) -> None:
        self.open_store = open_store
        self.limits = limits or ImageLimits()
        self.may_read = may_read
        self.http_timeout_s = http_timeout_s
        self._http = http_client
        self._owns_http = http_client is None
        self._lock = threading.Lock()

    def fetch(self, messages: Sequence[Mapping[str, Any]]) -> list[RowImage]:
        """The images of `messages` (a row's `messages` or `as_chat`) in order of appearance;
        `ImageRejected` for the first that cannot be used."""
        parts = list(iter_image_parts(messages))
        if len(parts) > self.limits.max_images_per_row:
            raise ImageRejected("the row", f"it gives {len(parts)} images, over the limit of "
                                           f"{self.limits.max_images_per_row} per row (image_max_per_row)")
        return [self._image(where, url, detail) for where, url, detail in parts]

    def _image(self, where: str, url: Any, detail: Any) -> RowImage:
        try:
            image = decode_image(self._bytes(url), self.limits)
        except ImageProblem as problem:
            raise ImageRejected(where, str(problem)) from None
        return RowImage(image, detail if detail in DETAILS else None)

    def _bytes(self, url: Any) -> bytes:
        if not isinstance(url, str):
            raise ImageProblem("the image's url must be a string")
        source = image_source(url)
        if source is None:
            raise ImageProblem(str(image_url_problem(url)))
        if source == ImageSource.DATA:
            return read_data_url(url, self.limits)
        if source == ImageSource.HTTP:
            self._check_host(url)
            return read_http(self._client(), url, self.limits)
        refused = self.may_read(url) if self.may_read is not None else None
        if refused is not None:
            raise ImageProblem(refused)
        store, key = self.open_store(url)
        return read_store(store, key, url, self.limits)

    def _check_host(self, url: str) -> None:
        parts = urlsplit(url)
        host = (parts.hostname or "").lower()
        try:
            port = parts.port
        except ValueError:
            raise ImageProblem(f"image url {url[:120]} has a port that is not a number") from None
        allowed = self.limits.allowed_http_hosts
        if host not in allowed and (port is None or f"{host}:{port}" not in allowed):
            raise ImageProblem(f"http(s) image host {host} is not allowed here (image_http_hosts)")

    def _client(self) -> httpx.Client:
        with self._lock:
            if self._http is None:
                self._http = httpx.Client(timeout=self.http_timeout_s, follow_redirects=False)
            return self._http

    def close(self) -> None:
        """Close the http client the fetcher made (one it was given stays open)."""
        with self._lock:
            if self._owns_http and self._http is not None:
                self._http.close()
                self._http = None

    def __enter__(self) -> ImageFetcher:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
