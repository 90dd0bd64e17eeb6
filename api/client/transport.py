"""HTTP under the SDK: base URL, API key, timeouts, retries with backoff, errors as `ApiError`.

Every resource (`client.jobs`, and whatever else is mounted on the client) talks to the server through
`Client._transport.request(method, path, *, json=None, params=None, idempotent=...)`, which returns
the successful `httpx.Response` or raises `ApiError(status_code, message)`.

Retries: only calls marked `idempotent` (GET, cancel, and POST /jobs with an idempotency key) are
retried, on a connection error or timeout, a 429 or a 5xx, `retries` times with exponential backoff
and jitter (a `Retry-After` header is honoured up to `MAX_RETRY_AFTER_S`). Any other call goes once.
When the retries are spent, the last `httpx` error (connection) or `ApiError` (status) is raised.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import httpx

from bulkinfer.api.client.errors import ApiError

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
MAX_RETRY_AFTER_S = 60.0
USER_AGENT = "bulkinfer-sdk/0.1"

# A factory of the multipart `files` argument: called once per attempt, so a retry re-reads the file.
FilesFactory = Callable[[], Mapping[str, Any]]

H = TypeVar("H", httpx.Client, httpx.AsyncClient)


@dataclass(frozen=True)
class RetryPolicy:
    retries: int = 3  # attempts after the first
    backoff: float = 0.5  # seconds before the first retry; doubles each time
    max_backoff: float = 8.0

    def delay(self, attempt: int, response: httpx.Response | None) -> float:
        """Seconds to sleep before retry number `attempt` (0-based)."""
        retry_after = _retry_after(response)
        if retry_after is not None:
            return retry_after
        base = min(self.max_backoff, self.backoff * (2 ** attempt))
        return base * (0.5 + random.random() / 2)  # jitter: no retrying in lockstep

    def should_retry(self, attempt: int, idempotent: bool, response: httpx.Response | None) -> bool:
        if not idempotent or attempt >= self.retries:
            return False
        return response is None or response.status_code in RETRY_STATUSES


def _retry_after(response: httpx.Response | None) -> float | None:
    if response is None:
        return None
    try:
        seconds = float(response.headers.get("retry-after", ""))
    except ValueError:
        return None
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_S)


def raise_for_status(response: httpx.Response) -> None:
    """Raise `ApiError` with the server's `detail` and `messages` unless the response succeeded."""
    if response.is_success:
        return
    if not response.is_stream_consumed:
        response.read()
    raise error_from(response)


async def araise_for_status(response: httpx.Response) -> None:
    if response.is_success:
        return
    if not response.is_stream_consumed:
        await response.aread()
    raise error_from(response)


def error_from(response: httpx.Response) -> ApiError:
    try:
        body = response.json()
        message, messages = str(body.get("detail", body)), [str(m) for m in body.get("messages") or []]
    except (ValueError, AttributeError):
        message, messages = response.text.strip() or response.reason_phrase, []
    return ApiError(response.status_code, message, messages)


def default_headers(api_key: str | None, headers: Mapping[str, str] | None) -> dict[str, str]:
    merged = {"User-Agent": USER_AGENT, **dict(headers or {})}
    if api_key:
        merged["Authorization"] = f"Bearer {api_key}"
    return merged


class _Clients(Generic[H]):
    """What both transports hold: one httpx client (`HTTP`) for the API, and a bare one, made on first
    use, for presigned part URLs (those carry their own signature: sending the API key would break it)."""

    HTTP: type[H]

    def __init__(self, base_url: str, *, api_key: str | None = None, timeout: float = 30.0,
                 retry: RetryPolicy | None = None, headers: Mapping[str, str] | None = None,
                 http_transport: Any = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.retry = retry or RetryPolicy()
        self.http: H = self.HTTP(base_url=self.base_url, timeout=timeout,
                              headers=default_headers(api_key, headers), transport=http_transport)
        self._downloads: H | None = None
        self._timeout = timeout
        self._http_transport = http_transport

    def _external(self) -> H:
        if self._downloads is None:
            self._downloads = self.HTTP(timeout=self._timeout, transport=self._http_transport)
        return self._downloads


class Transport(_Clients[httpx.Client]):
    """The sync transport over `httpx.Client` (`http_transport`: an `httpx.BaseTransport`)."""

    HTTP = httpx.Client
    sleep: Callable[[float], None] = staticmethod(time.sleep)  # tests set their own on the instance

    def request(self, method: str, path: str, *, json: Any = None, params: Mapping[str, Any] | None = None,
                idempotent: bool, data: Mapping[str, Any] | None = None,
                files: FilesFactory | None = None) -> httpx.Response:
        """The successful response, after retries when `idempotent`; else `ApiError`."""
        attempt = 0
        while True:
            response: httpx.Response | None = None
            try:
                response = self.http.request(method, path, json=json, params=params, data=data,
                                             files=files() if files else None)
            except httpx.TransportError:
                if not self.retry.should_retry(attempt, idempotent, None):
                    raise
            if response is not None:
                if response.is_success or not self.retry.should_retry(attempt, idempotent, response):
                    raise_for_status(response)
                    return response
            self.sleep(self.retry.delay(attempt, response))
            attempt += 1

    @contextmanager
    def stream(self, method: str, url: str, *, params: Mapping[str, Any] | None = None,
               external: bool = False) -> Iterator[httpx.Response]:
        """A streamed, idempotent request (retried until its status arrives). `external`: an absolute
        URL fetched without the API's headers (a presigned part URL)."""
        http = self._external() if external else self.http
        attempt, yielded = 0, False
        while True:
            try:
                with http.stream(method, url, params=params) as response:
                    if response.is_success or not self.retry.should_retry(attempt, True, response):
                        raise_for_status(response)
                        yielded = True
                        yield response
                        return
                    delay = self.retry.delay(attempt, response)
            except httpx.TransportError:
                if yielded or not self.retry.should_retry(attempt, True, None):
                    raise  # a failure while the caller reads the body is the caller's to handle
                delay = self.retry.delay(attempt, None)
            self.sleep(delay)
            attempt += 1

    def close(self) -> None:
        self.http.close()
        if self._downloads is not None:
            self._downloads.close()


class AsyncTransport(_Clients[httpx.AsyncClient]):
    """`Transport` over `httpx.AsyncClient` (`http_transport`: an `httpx.AsyncBaseTransport`): the
    same retries, `await`ed."""

    HTTP = httpx.AsyncClient

    async def request(self, method: str, path: str, *, json: Any = None,
                      params: Mapping[str, Any] | None = None, idempotent: bool,
                      data: Mapping[str, Any] | None = None,
                      files: FilesFactory | None = None) -> httpx.Response:
        attempt = 0
        while True:
            response: httpx.Response | None = None
            try:
                response = await self.http.request(method, path, json=json, params=params, data=data,
                                                   files=files() if files else None)
            except httpx.TransportError:
                if not self.retry.should_retry(attempt, idempotent, None):
                    raise
            if response is not None:
                if response.is_success or not self.retry.should_retry(attempt, idempotent, response):
                    await araise_for_status(response)
                    return response
            await asyncio.sleep(self.retry.delay(attempt, response))
            attempt += 1

    @asynccontextmanager
    async def stream(self, method: str, url: str, *, params: Mapping[str, Any] | None = None,
                     external: bool = False) -> AsyncIterator[httpx.Response]:
        http = self._external() if external else self.http
        attempt, yielded = 0, False
        while True:
            try:
                async with http.stream(method, url, params=params) as response:
                    if response.is_success or not self.retry.should_retry(attempt, True, response):
                        await araise_for_status(response)
                        yielded = True
                        yield response
                        return
                    delay = self.retry.delay(attempt, response)
            except httpx.TransportError:
                if yielded or not self.retry.should_retry(attempt, True, None):
                    raise  # a failure while the caller reads the body is the caller's to handle
                delay = self.retry.delay(attempt, None)
            await asyncio.sleep(delay)
            attempt += 1

    async def aclose(self) -> None:
        await self.http.aclose()
        if self._downloads is not None:
            await self._downloads.aclose()
