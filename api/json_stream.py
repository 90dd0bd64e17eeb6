"""A big JSON body read one array item at a time, in bounded memory.

`{"requests": [item, item, …]}` with 100,000 items would be ~2 GB of Python objects parsed whole
(and `json.loads` holds the event loop while it runs). Here the body lies in a file (spooled to disk
as it arrives) and ijson's C parser reads it in small pieces: each item is built on its own from
the parser's events, under limits checked while it is built (nesting depth, values in one item),
handed to the caller, and dropped. Memory: one item, whatever the body.

yajl (ijson's C parser) turns a lone high-surrogate escape (`"\\ud800"`) into `?` without a word
(and a lone low one into bytes that fail to decode), so the raw text is scanned for them as it is
read: such a body is refused, as api/json_body.py refuses it for the small bodies.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import IO, NamedTuple

import ijson

# yajl lexes a string split across reads again from its start at each read: pieces of 8 MiB keep a
# 64 MiB string to a few passes (64 KiB pieces took 20 s for a 20 MiB string), at 8 MiB of memory.
READ_BYTES = 8 << 20
# A real `\uD800`-`\uDBFF` escape (an even run of backslashes before it) not followed by a low half.
_LONE_HIGH = re.compile(rb"(?<!\\)(?:\\\\)*\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})")
_ANY_HIGH = re.compile(rb"\\u[dD][89abAB]")  # cheap first look: most bodies have none
_OVERLAP = 16  # bytes of the last piece kept for a match that spans two pieces


class JsonBodyProblem(ValueError):
    """Why the body cannot be read; the message names the place and the limit."""


class ArrayItem(NamedTuple):
    value: object
    longest_text: int  # characters of its longest string: a caller may write a long one differently


class _Limits:
    def __init__(self, max_depth: int, max_values: int) -> None:
        self.max_depth = max_depth
        self.max_values = max_values


def iter_array_items(body: IO[bytes], key: str, *, max_items: int, max_depth: int,
                     max_values_per_item: int) -> Iterator[ArrayItem]:
    """The items of the array at `key` of the JSON object in `body`, one at a time. Raises
    `JsonBodyProblem` for a body that is not such an object (another key, a second `key`, not an
    array), not JSON or not valid Unicode, past `max_items` items, or with an item nested deeper than
    `max_depth` (the item itself is level 1) or holding more than `max_values_per_item` values."""
    events = ijson.parse(_ScannedReader(body), buf_size=READ_BYTES, use_float=True)
    limits = _Limits(max_depth, max_values_per_item)
    try:
        _expect(events, "start_map", "the body must be a JSON object")
        seen_key = False
        for _prefix, event, value in events:
            if event == "end_map":
                break
            name = str(value)
            if name != key:
                raise JsonBodyProblem(f"{_short(name)}: Extra inputs are not permitted")
            if seen_key:
                raise JsonBodyProblem(f"{key}: given twice")
            seen_key = True
            _expect(events, "start_array", f"{key}: must be an array")
            count = 0
            for item in _items(events, key, limits):
                count += 1
                if count > max_items:
                    raise JsonBodyProblem(f"{key}: at most {max_items:,} items")
                yield item
                del item  # the caller's alone: dropped before the next is built
        if not seen_key:
            raise JsonBodyProblem(f"{key}: required")
        for _event in events:  # the parser's own check that nothing follows the object
            raise JsonBodyProblem("the body holds more than one JSON value")
    except ijson.JSONError as error:
        raise JsonBodyProblem(f"the body is not valid JSON: {_first_line(error)}") from None
    except UnicodeDecodeError:
        raise JsonBodyProblem("the body is not valid UTF-8 text (or holds a lone surrogate escape)") from None


def _expect(events: Iterator[tuple[str, str, object]], expected: str, message: str) -> None:
    _prefix, event, _value = next(events, ("", "", None))
    if event != expected:
        raise JsonBodyProblem(message)


def _items(events: Iterator[tuple[str, str, object]], key: str, limits: _Limits) -> Iterator[ArrayItem]:
    """Each item of the open array, built from its events; returns at the array's end."""
    index = 0
    for _prefix, event, value in events:
        if event == "end_array":
            return
        yield _build(event, value, events, f"{key}.{index}", limits)
        index += 1


def _build(event: str, value: object, events: Iterator[tuple[str, str, object]], where: str,
           limits: _Limits) -> ArrayItem:
    """One value from its first event on, without recursion (any depth is refused, not recursed)."""
    if event not in ("start_map", "start_array"):
        return ArrayItem(value, len(value) if isinstance(value, str) else 0)
    root: dict[str, object] | list[object] = {} if event == "start_map" else []
    stack: list[dict[str, object] | list[object]] = [root]
    pending_key = ""
    values = 1
    longest = 0
    for _prefix, event, value in events:
        container = stack[-1]
        if event == "map_key":
            pending_key = str(value)
            continue
        if event in ("end_map", "end_array"):
            stack.pop()
            if not stack:
                return ArrayItem(root, longest)
            continue
        values += 1
        if values > limits.max_values:
            raise JsonBodyProblem(f"{where}: more than {limits.max_values:,} values in one item")
        item: object = value
        if event == "string":
            longest = max(longest, len(value))  # type: ignore[arg-type]
        if event in ("start_map", "start_array"):
            if len(stack) >= limits.max_depth:
                raise JsonBodyProblem(f"{where}: nested too deeply (at most {limits.max_depth} levels of "
                                      "arrays and objects)")
            item = {} if event == "start_map" else []
        if isinstance(container, list):
            container.append(item)
        else:
            container[pending_key] = item
        if isinstance(item, dict | list):
            stack.append(item)
    raise JsonBodyProblem("the body is not valid JSON: it ends inside a value")


class _ScannedReader:
    """`body` as ijson reads it, each piece looked through for a lone surrogate escape first."""

    def __init__(self, body: IO[bytes]) -> None:
        self.body = body
        self.tail = b""

    def read(self, size: int = READ_BYTES) -> bytes:
        piece = self.body.read(size)
        window = self.tail + piece
        if _ANY_HIGH.search(window) and _lone_high(window, at_end=not piece):
            raise JsonBodyProblem("the body holds a lone surrogate escape (a \\ud800-\\udbff escape not "
                                  "followed by its low half); JSON text must be valid Unicode")
        self.tail = _tail(window)
        return piece


def _lone_high(window: bytes, at_end: bool) -> bool:
    for match in _LONE_HIGH.finditer(window):
        # At the window's end the low half may still be on its way: the next window decides.
        if at_end or match.end() + 6 <= len(window):
            return True
    return False


def _tail(window: bytes) -> bytes:
    """The window's last bytes to look at again with the next piece: at least _OVERLAP, started
    before any run of backslashes so the run's length (an escape or not) is seen whole."""
    start = max(0, len(window) - _OVERLAP)
    while start > 0 and window[start - 1:start] == b"\\":
        start -= 1
    return window[start:]


def _short(text: str) -> str:
    return text if len(text) <= 64 else text[:64] + "…"


def _first_line(error: Exception) -> str:
    said = error.args[0] if error.args else ""
    text = said.decode("utf-8", "replace") if isinstance(said, bytes) else str(said)
    return text.strip().splitlines()[0][:200] if text.strip() else type(error).__name__
