"""Prompt templates: literal text with `{column}` placeholders (`{{` and `}}` for braces)."""

from __future__ import annotations

import string
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class MissingColumn(KeyError):
    """The row has no value for a placeholder: the column is absent, or null in this row."""

    def __init__(self, column: str, is_null: bool = False) -> None:
        super().__init__(column)
        self.column = column
        self.is_null = is_null

    def __str__(self) -> str:
        return f"template column {self.column!r} is {'null in' if self.is_null else 'missing from'} the row"


@dataclass(frozen=True)
class PromptTemplate:
    """Parsed once per job; `fill` is called once per row."""

    pieces: tuple[tuple[str, str | None], ...]  # (literal text, column or None)

    @classmethod
    def parse(cls, text: str, fixed_text: bool = False) -> PromptTemplate:
        """Raises ValueError naming the problem: no placeholders (unless `fixed_text`: the same text
        for every row, as an image job's question), format specs, bad braces."""
        pieces = []
        try:
            parsed = list(string.Formatter().parse(text))
        except ValueError as error:
            raise ValueError(f"unbalanced braces ({error}); write {{{{ or }}}} for a literal brace") from None
        for literal, field, format_spec, conversion in parsed:
            if field is not None and (format_spec or conversion):
                raise ValueError(f"placeholder {{{field}...}} has a conversion or format spec; "
                                 "only plain {column} placeholders are supported")
            if field == "":
                raise ValueError("empty placeholder {}; name a column, e.g. {question}")
            pieces.append((literal, field))
        if not fixed_text and not any(field for _, field in pieces):
            raise ValueError("template has no {column} placeholder (one fixed text for every row needs "
                             "an image_column)")
        return cls(tuple(pieces))

    @property
    def columns(self) -> list[str]:
        """The columns the template reads, in first-use order, without repeats."""
        return list(dict.fromkeys(field for _, field in self.pieces if field))

    def fill(self, record: Mapping[str, Any]) -> str:
        """The prompt for one row; raises `MissingColumn` if the row lacks a placeholder's column."""
        parts = []
        for literal, field in self.pieces:
            parts.append(literal)
            if field is not None:
                if field not in record:
                    raise MissingColumn(field)
                value = record[field]
                if value is None:  # a silent "" or "None" would send a different prompt
                    raise MissingColumn(field, is_null=True)
                parts.append(str(value))
        return "".join(parts)
