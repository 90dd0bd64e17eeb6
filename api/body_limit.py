"""A size limit on every request body but an upload's, before any route reads it.

Routes that take a JSON body through FastAPI (`POST /schedules`, `POST /jobs/{id}/retry`) read it
whole before validating it, so one tenant's multi-gigabyte body would take the API process (every
tenant's) out of memory. Here a body declared longer than the limit is refused at once, and one
sent without a length is read up to the limit and refused past it: 413 naming the limit. Uploads
(`multipart/form-data`) stream into the store under their own limit (max_upload_bytes).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.types import Message, Receive, Scope, Send

from api.errors import HttpError, error_response

MAX_BODY_BYTES = 1 << 20  # a job spec, a schedule or a retry request is a few KiB

App = Callable[[Scope, Receive, Send], Awaitable[None]]


def _headers(scope: Scope) -> dict[bytes, bytes]:
    return {name.lower(): value for name, value in scope.get("headers") or []}


def _too_large(limit: int) -> HttpError:
    return HttpError(413, f"the request body is larger than {limit} bytes; send rows as an upload "
                          "(multipart) or name them by input_uri")


class BodyLimit:
    def __init__(self, app: App, limit: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE"):
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        if headers.get(b"content-type", b"").split(b";", 1)[0].strip().lower() == b"multipart/form-data":
            await self.app(scope, receive, send)
            return
        declared = headers.get(b"content-length")
        if declared is not None and declared.strip().isdigit():
            if int(declared) > self.limit:
                await error_response(_too_large(self.limit))(scope, receive, send)
                return
            await self.app(scope, receive, send)  # the server holds the body to its declared length
            return
        # No length given (chunked): read up to the limit here, then hand the route the same messages.
        messages: list[Message] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.limit:
                await error_response(_too_large(self.limit))(scope, receive, send)
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)
