"""One JSON value from untrusted text, with every way `json.loads` can fail made one error.

Besides `JSONDecodeError`, `json.loads` raises `RecursionError` on deep nesting and a plain
`ValueError` on an integer longer than Python's int conversion limit (4,300 digits); a value nested
close to the interpreter's recursion limit parses, then breaks whatever walks it later (a writer, a
hash). So values nested deeper than `MAX_NESTING` are refused here, where the row is read.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

MAX_NESTING = 100  # arrays/objects inside each other: far beyond any chat request or JSON schema


class UnreadableJson(ValueError):
    """The text is not one readable JSON value; the message says why, for a row's error."""


def loads_untrusted(data: bytes | str) -> Any:
    """The JSON value in `data`; raises `UnreadableJson` (never RecursionError or a bare ValueError)."""
    try:
        value = json.loads(data)
    except UnicodeDecodeError as error:
        raise UnreadableJson(f"not UTF-8 text ({error.reason})") from None
    except json.JSONDecodeError as error:
        raise UnreadableJson(f"invalid JSON: {error.msg} at column {error.colno}") from None
    except RecursionError:
        raise UnreadableJson(f"invalid JSON: nested more than {MAX_NESTING} levels deep") from None
    except ValueError as error:  # int() past sys.get_int_max_str_digits()
        raise UnreadableJson(f"invalid JSON: a number too long to read ({_first_sentence(error)})") from None
    if _may_nest_deeper(data) and nesting_depth(value) > MAX_NESTING:
        raise UnreadableJson(f"invalid JSON: nested more than {MAX_NESTING} levels deep")
    return value


def nesting_depth(value: Any) -> int:
    """How many arrays/objects deep `value` goes (0 for a scalar); iterative, so any depth is safe."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children: Iterable[Any]
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def _may_nest_deeper(data: bytes | str) -> bool:
    # Cheap: a text with few brackets cannot nest deep, so most rows skip the walk.
    if isinstance(data, str):
        return data.count("[") + data.count("{") > MAX_NESTING
    return data.count(b"[") + data.count(b"{") > MAX_NESTING


def _first_sentence(error: ValueError) -> str:
    return str(error).split(";")[0]
