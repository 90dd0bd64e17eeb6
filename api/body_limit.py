"""A size limit, and the JSON checks of api/json_body.py, on every request body but an upload's,
before any route reads it.

Routes that take a JSON body through FastAPI (`POST /schedules`, `POST /jobs/{id}/retry`) read it
whole before validating it, so one tenant's multi-gigabyte body would take the API process (every
tenant's) out of memory. Here a body declared longer than the limit is refused at once, and one
sent without a length is read up to the limit and refused past it: 413 naming the limit. Uploads
(`multipart/form-data`) stream into the store under their own limit (max_upload_bytes).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.types import Message, Receive, Scope, Send

from bulkinfer.api.errors import HttpError, error_response
from bulkinfer.api.json_body import json_problem

MAX_BODY_BYTES = 1 << 20  # a job spec, a schedule or a retry request is a few KiB

App = Callable[[Scope, Receive, Send], Awaitable[None]]


def _headers(scope: Scope) -> dict[bytes, bytes]:
    return {name.lower(): value for name, value in scope.get("headers") or []}


def _too_large(limit: int) -> HttpError:
    return HttpError(413, f"the request body is larger than {limit} bytes; send rows as an upload "
                          "(multipart) or name them by input_uri")


def _takes_json(headers: dict[bytes, bytes]) -> bool:
    content_type = headers.get(b"content-type", b"").split(b";", 1)[0].strip().lower()
    return content_type in (b"", b"application/json") or content_type.endswith(b"+json")


class BodyCheck:
    """Every request body but an upload's, read once before any route: refused past `limit` (413),
    and a JSON one refused when `json_problem` finds it nested too deep or not valid Unicode (422);
    otherwise the route gets the same messages."""

    def __init__(self, app: App, limit: int = MAX_BODY_BYTES,
                 path_limits: dict[str, int] | None = None) -> None:
        self.app = app
        self.limit = limit
        self.path_limits = path_limits or {}  # routes whose body is the work itself (a message batch)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE"):
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        if headers.get(b"content-type", b"").split(b";", 1)[0].strip().lower() == b"multipart/form-data":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        limit = self.path_limits.get(path, self.limit)
        declared = headers.get(b"content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > limit:
            await error_response(_too_large(limit), path)(scope, receive, send)
            return
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
            problem = json_problem(b"".join(message.get("body", b"") for message in messages))
            if problem is not None:
                await error_response(HttpError(422, problem), path)(scope, receive, send)
                return

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)
