"""JSON request bodies checked once, before any route reads them: nesting depth and valid Unicode.

Python's `json` parses `[[[[…` 100,000 deep by recursion (a `RecursionError`, which would be a
500), and takes `"\\ud800"` escapes into strings no file name, Redis key or UTF-8 response can
hold. `json_problem` says which, for the request-body check that runs before every route
(api/body_limit.py: a 422 naming the problem) and for the multipart spec field. A body that
is simply not JSON is left to the route, which says so in its own words.

The walk holds one iterator per open array or object (at most `MAX_JSON_DEPTH`) and builds a
value's path only for the problem it reports: checking costs no memory beyond the parsed value.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

from bulkinfer.api.errors import encodable

MAX_JSON_DEPTH = 200  # well past a spec with a deep response_format, whose own limit (32) then speaks


def json_problem(raw: bytes | str, what: str = "the JSON body") -> str | None:
    """Why `raw` may not be taken as JSON input: nested too deep, or a string with a lone
    surrogate. None when it is fine, or not JSON at all (the caller reports that)."""
    try:
        data = json.loads(raw)
    except RecursionError:
        return _too_deep(what)
    except ValueError:
        return None
    return value_problem(data, what)


def value_problem(data: object, what: str, max_depth: int = MAX_JSON_DEPTH) -> str | None:
    """Why a parsed JSON value may not be taken: nested deeper than `max_depth`, or a string (a
    value or an object's key) with a lone surrogate, named by its path. None when it is fine."""
    frames: list[tuple[Iterator[tuple[object, object]], str]] = []  # (children left, key of the container)
    if isinstance(data, dict | list):
        frames.append((_children(data), ""))
    elif isinstance(data, str) and not is_unicode(data):
        return _lone_surrogate(what, [], data)
    while frames:
        step = next(frames[-1][0], None)
        if step is None:
            frames.pop()
            continue
        key, value = step
        if isinstance(value, dict | list):
            if len(frames) + 1 > max_depth:
                return _too_deep(what, max_depth)
            frames.append((_children(value), str(key)))
        elif isinstance(value, str) and not is_unicode(value):
            return _lone_surrogate(what, [name for _children_left, name in frames[1:]] + [str(key)], value)
    return None


def _children(container: dict[object, object] | list[object]) -> Iterator[tuple[object, object]]:
    """(key, value) of each item; an object's key is checked first as a value of its own, named
    '<key> (a key)'."""
    if isinstance(container, list):
        yield from enumerate(container)
        return
    for key, value in container.items():
        yield f"{key} (a key)", key
        yield key, value


def is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _too_deep(what: str, max_depth: int = MAX_JSON_DEPTH) -> str:
    return f"{what} is nested too deeply (at most {max_depth} levels of arrays and objects)"


def _lone_surrogate(what: str, path: list[str], text: str) -> str:
    where = ".".join(path)
    place = f"{what}: {encodable(where)}" if where else what
    return (f"{place}: {encodable(text)[:80]!r} holds a lone surrogate escape; JSON text must be "
            "valid Unicode (a \\ud800-\\udfff escape only as half of a pair)")
