"""JSON request bodies checked once, before any route reads them: nesting depth and valid Unicode.

Python's `json` parses `[[[[…` 100,000 deep by recursion (a `RecursionError`, which would be a
500), and takes `"\\ud800"` escapes into strings no file name, Redis key or UTF-8 response can
hold. `json_problem` says which, for the request-body check that runs before every route
(api/body_limit.py: a 422 naming the problem) and for the multipart spec field. A body that
is simply not JSON is left to the route, which says so in its own words.
"""

from __future__ import annotations

import json

from bulkinfer.api.errors import encodable

MAX_JSON_DEPTH = 200  # well past a spec with a deep response_format, whose own limit (32) then speaks


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
