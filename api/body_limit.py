"""A size limit on every request body, whatever its content type, and the JSON checks of
api/json_body.py on the small ones, before any route reads them.

Three kinds of body:
- an upload (`multipart/form-data` to `POST /jobs` or `POST /v1/files`) streams into the store: it
  is counted as it passes, and stopped past max_upload_bytes (plus room for the form's other fields);
- a body that is the work itself (`POST /v1/messages/batches`, up to max_message_batch_bytes) is
  read by its route from a spooled file a request at a time (api/json_stream.py): counted as it
  passes, and stopped past its limit;
- every other body (a job spec, a schedule, a batch's create request: a few KiB) is read here, at
  most `limit` bytes (1 MiB), and a JSON one is checked off the event loop (nesting depth, valid
  Unicode: a 422 naming the problem) before the route gets the same bytes.

A body declared longer than its limit is refused at once (413 naming the limit); one sent without a
length is refused as soon as it passes the limit. A streamed body's route then sees it end there,
so nothing past the limit is read, kept or drained.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.concurrency import run_in_threadpool
from starlette.types import Message, Receive, Scope, Send

from bulkinfer.api.errors import HttpError, error_response
from bulkinfer.api.json_body import json_problem

MAX_BODY_BYTES = 1 << 20  # a job spec, a schedule or a retry request is a few KiB
IN_LOOP_CHECK_BYTES = 16 << 10  # a body this small is checked on the event loop: no thread hop

App = Callable[[Scope, Receive, Send], Awaitable[None]]


def _headers(scope: Scope) -> dict[bytes, bytes]:
    return {name.lower(): value for name, value in scope.get("headers") or []}


def _content_type(headers: dict[bytes, bytes]) -> bytes:
    return headers.get(b"content-type", b"").split(b";", 1)[0].strip().lower()


def _too_large(limit: int) -> HttpError:
    return HttpError(413, f"the request body is larger than {limit:,} bytes (this route's limit); send rows "
                          "as an upload (multipart) or name them by input_uri")


def _takes_json(headers: dict[bytes, bytes]) -> bool:
    content_type = _content_type(headers)
    return content_type in (b"", b"application/json") or content_type.endswith(b"+json")


class BodyCheck:
    """Every request body, read at most up to its route's limit: `streamed` paths (any content
    type) and `uploads` paths (multipart) are counted as their routes read them; the rest are read
    here, at most `limit` bytes, and a JSON one checked by `json_problem` (422)."""

    def __init__(self, app: App, limit: int = MAX_BODY_BYTES, streamed: dict[str, int] | None = None,
                 uploads: dict[str, int] | None = None) -> None:
        self.app = app
        self.limit = limit
        self.streamed = streamed or {}  # routes whose body is the work itself (a message batch)
        self.uploads = uploads or {}  # routes that take a multipart upload

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        path = scope.get("path", "")
        limit, streamed = self._limit(path, headers)
        declared = headers.get(b"content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > limit:
            await error_response(_too_large(limit), path)(scope, receive, send)
            return
        if streamed:
            await self.app(scope, _Counted(receive, limit), send)
            return
        await self._buffered(scope, receive, send, headers, limit)

    def _limit(self, path: str, headers: dict[bytes, bytes]) -> tuple[int, bool]:
        """(the body's limit, whether its route reads it as a stream)."""
        if path in self.streamed:
            return self.streamed[path], True
        if path in self.uploads and _content_type(headers) == b"multipart/form-data":
            return self.uploads[path], True
        return self.limit, False

    async def _buffered(self, scope: Scope, receive: Receive, send: Send, headers: dict[bytes, bytes],
                        limit: int) -> None:
        path = scope.get("path", "")
        messages: list[Message] = []
        size = 0
        while True:  # a body sent without a length (chunked) is refused as soon as it passes the limit
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > limit:
                await error_response(_too_large(limit), path)(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        if size and _takes_json(headers):
            body = b"".join(message.get("body", b"") for message in messages)
            problem = json_problem(body) if size <= IN_LOOP_CHECK_BYTES else await run_in_threadpool(
                json_problem, body)
            if problem is not None:
                await error_response(HttpError(422, problem), path)(scope, receive, send)
                return

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)


class _Counted:
    """`receive` for a streamed body: a 413 (raised into the route reading it) once the body passes
    `limit`, and after that an ended body, so a route that drains what is left reads nothing more."""

    def __init__(self, receive: Receive, limit: int) -> None:
        self.receive = receive
        self.limit = limit
        self.size = 0
        self.stopped = False

    async def __call__(self) -> Message:
        if self.stopped:
            return {"type": "http.request", "body": b"", "more_body": False}
        message = await self.receive()
        if message["type"] == "http.request":
            self.size += len(message.get("body", b""))
            if self.size > self.limit:
                self.stopped = True
                raise _too_large(self.limit)
        return message
