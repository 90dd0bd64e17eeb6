"""A JSON value written out in pieces, its very long strings with as few copies as can be.

`json.dumps` of a value holding a 60 MiB string makes an escaped copy of it, then the joined text,
then its bytes: three copies at once. Here each string of at least `long_text_chars` is swapped
for a marker, the small rest encoded as usual, and the long string written from its UTF-8 bytes
(one copy; the str itself dropped as soon as it is encoded), escaped only if it needs it.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterator
from typing import Any

COMPACT_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))  # shared with its callers
_NEEDS_ESCAPE = re.compile(rb'["\\\x00-\x1f]')


def json_pieces(value: dict[str, Any] | list[Any], long_text_chars: int) -> Iterator[bytes]:
    """`value` as compact JSON (as `json.dumps(value, ensure_ascii=False, separators=(",", ":"))`),
    a piece at a time. Its long strings are taken out of it as they are written."""
    marker = secrets.token_hex(16)  # no string of the value can hold it by chance
    long_texts = _swap_long_texts(value, long_text_chars, marker)
    text = COMPACT_JSON.encode(value)
    parts = re.split(f'"\\\\u0000{marker}:(\\d+)"', text)
    for index, part in enumerate(parts):
        if index % 2 == 0:
            yield part.encode()
            continue
        position = int(part)
        long_text, long_texts[position] = long_texts[position], ""
        encoded = long_text.encode()
        del long_text  # the bytes alone from here
        if _NEEDS_ESCAPE.search(encoded) is None:
            yield b'"'
            yield encoded
            yield b'"'
        else:
            yield COMPACT_JSON.encode(encoded.decode()).encode()


def _swap_long_texts(value: dict[str, Any] | list[Any], long_text_chars: int, marker: str) -> list[str]:
    """Each string of at least `long_text_chars` in `value` (not keys), replaced in place by
    '\\0<marker>:<its index in the list returned>'."""
    long_texts: list[str] = []
    pending: list[dict[str, Any] | list[Any]] = [value]
    while pending:
        container = pending.pop()
        places = container.items() if isinstance(container, dict) else enumerate(container)
        for place, item in list(places):
            if isinstance(item, dict | list):
                pending.append(item)
            elif isinstance(item, str) and len(item) >= long_text_chars:
                container[place] = f"\x00{marker}:{len(long_texts)}"  # type: ignore[index, call-overload]
                long_texts.append(item)
    return long_texts
