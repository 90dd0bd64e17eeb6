"""JSON request bodies checked once, before any route reads them: nesting depth and valid Unicode.

Python's `json` parses `[[[[…` 100,000 deep by recursion (a `RecursionError`, which would be a
500), and takes `"\\ud800"` escapes into strings no file name, Redis key or UTF-8 response can
hold. `JsonBodyCheck` (an ASGI middleware) refuses both with a 422 naming the problem for every
route that takes a JSON body; the multipart spec field goes through `json_problem` too. A body that
is simply not JSON is left to the route, which says so in its own words.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from api.errors import HttpError, encodable, error_response

MAX_JSON_DEPTH = 200  # well past a spec with a deep response_format, whose own limit (32) then speaks
MAX_CHECKED_BYTES = 1 << 20  # larger JSON bodies are refused by their route (413) unread

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def json_problem(raw: bytes | str, what: str = "the JSON body") -> str | None:
    """Why `raw` may not be taken as JSON input: nested too deep, or a string with a lone
    surrogate. None when it is fine, or not JSON at all (the caller reports that)."""
    try:
        data = json.loads(raw)
    except RecursionError:
        return f"{what} is nested too deeply (at most {MAX_JSON_DEPTH} levels of arrays and objects)"
    except ValueError:
        return None
    pending: list[tuple[object, int, str]] = [(data, 1, "")]
    while pending:
        value, depth, where = pending.pop()
        if isinstance(value, dict | list):
            if depth > MAX_JSON_DEPTH:
                return f"{what} is nested too deeply (at most {MAX_JSON_DEPTH} levels of arrays and objects)"
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                inner = f"{where}.{key}" if where else str(key)
                pending.extend(((key, depth, f"{inner} (a key)"), (item, depth + 1, inner)))
        elif isinstance(value, str) and not _is_unicode(value):
            place = f"{what}: {encodable(where)}" if where else what
            return (f"{place}: {encodable(value)[:80]!r} holds a lone surrogate escape; JSON text must be "
                    "valid Unicode (a \\ud800-\\udfff escape only as half of a pair)")
    return None


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _takes_json(scope: Scope) -> bool:
    if scope["method"] not in ("POST", "PUT", "PATCH"):
        return False
    headers = dict(scope.get("headers") or [])
    content_type = headers.get(b"content-type", b"").split(b";", 1)[0].strip().lower()
    return content_type in (b"", b"application/json") or content_type.endswith(b"+json")


class JsonBodyCheck:
    """Reads a JSON body (up to MAX_CHECKED_BYTES), refuses it with a 422 per `json_problem`, or
    hands the route the same bytes."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _takes_json(scope):
            await self.app(scope, receive, send)
            return
        messages: list[Message] = []
        size, complete = 0, False
        while size <= MAX_CHECKED_BYTES:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if not message.get("more_body", False):
                complete = True
                break
        if complete:
            problem = json_problem(b"".join(m.get("body", b"") for m in messages)) if size else None
            if problem is not None:
                await error_response(HttpError(422, problem))(scope, receive, send)
                return

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)
