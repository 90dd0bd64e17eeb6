"""The text encodings a CSV or TSV input may declare (`csv_encoding`).

Rows are found in the raw bytes (jobs/formats/csv_records.py), so an encoding must write `"`, the
delimiter and line ends as their ASCII bytes and never use those bytes inside another character:
UTF-8, or a single-byte code page that extends ASCII (Windows-1252, Latin-1, ISO-8859-*, Mac Roman…).
UTF-16 and the stateful or multi-byte Asian encodings are refused: such a file is read as UTF-8 once
converted.
"""

from __future__ import annotations

import codecs
from encodings.aliases import aliases
from functools import cache

DEFAULT_CSV_ENCODING = "utf-8"
_UTF8_NAMES = frozenset({"utf-8", "utf-8-sig", "ascii"})
# A code page may leave bytes undefined (Windows-1252 five, ISO-8859-6 forty-five); a multi-byte
# encoding leaves every lead byte undefined alone (Shift JIS sixty, most of them all 128).
_MAX_UNDEFINED_BYTES = 48


def check_csv_encoding(name: str) -> str:
    """The encoding's canonical name (`cp1252` for `Windows-1252`); `ValueError` saying why not."""
    try:
        codec = codecs.lookup(name)
    except LookupError:
        raise ValueError(f"unknown text encoding {name!r} (e.g. utf-8, cp1252, latin-1)") from None
    if codec.name in _UTF8_NAMES or _extends_ascii_one_byte_a_character(codec.name):
        return codec.name
    raise ValueError(f"{name!r} is not an encoding CSV rows can be read in: use UTF-8 or a single-byte "
                     "code page such as cp1252 or latin-1 (convert the file to UTF-8 otherwise)")


def _extends_ascii_one_byte_a_character(name: str) -> bool:
    try:
        if bytes(range(128)).decode(name) != "".join(map(chr, range(128))):
            return False
    except (UnicodeDecodeError, LookupError):
        return False
    undefined = 0
    for byte in range(128, 256):
        try:
            decoded = bytes([byte]).decode(name)
        except UnicodeDecodeError:
            undefined += 1
            continue
        if len(decoded) != 1:
            return False
    return undefined <= _MAX_UNDEFINED_BYTES


def is_utf8(name: str) -> bool:
    return codecs.lookup(name).name in _UTF8_NAMES


@cache
def csv_encoding_names() -> list[str]:
    """Every encoding `check_csv_encoding` accepts, by its canonical name (for the published schema)."""
    names = set()
    for name in set(aliases.values()) | {DEFAULT_CSV_ENCODING}:
        try:
            names.add(check_csv_encoding(name))
        except ValueError:
            continue
    return sorted(names)
