"""`OutputRow`: one row's outcome, the input of every output writer."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from jobs.formats.rows import Row, RowError, RowErrorCode


@dataclass(frozen=True, slots=True)
class OutputRow:
    """A completed row (`text` set) or a failed one (`error_code` set); a completed row whose text
    should have been JSON but is not carries both.
    """

    index: int
    row_id: str
    is_chat: bool = False
    wants_json: bool = False
    text: str | None = None
    json_value: Any = None
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    error_code: str | None = None
    error_message: str | None = None
    passthrough: dict[str, Any] = field(default_factory=dict)
    line: int | None = None  # JSONL: the line number within the shard

    @property
    def failed(self) -> bool:
        return self.error_code is not None

    @classmethod
    def completed(cls, row: Row, text: str, finish_reason: str, *, prompt_tokens: int, cached_tokens: int,
                  completion_tokens: int) -> OutputRow:
        """The engine's answer for `row`; parses it when the row asked for JSON."""
        wants_json = row.response_format is not None  # readers leave plain-text formats out
        json_value, error_code, error_message = None, None, None
        if wants_json:
            try:
                json_value = json.loads(text)
            except json.JSONDecodeError as error:
                error_code = RowErrorCode.INVALID_OUTPUT_JSON.value
                error_message = f"the output is not valid JSON ({error.msg}; finish_reason={finish_reason})"
        return cls(row.index, row.row_id, row.is_chat, wants_json, text, json_value, finish_reason,
                   prompt_tokens, cached_tokens, completion_tokens, error_code, error_message,
                   row.passthrough, row.line)

    @classmethod
    def from_error(cls, error: RowError) -> OutputRow:
        """A row the reader could not build."""
        return cls(error.index, error.row_id, error_code=error.code.value, error_message=error.message,
                   passthrough=error.passthrough, line=error.line)

    @classmethod
    def engine_failed(cls, row: Row, code: RowErrorCode, message: str) -> OutputRow:
        """A row the engine refused or failed (too long a prompt, a grammar that does not compile)."""
        return cls(row.index, row.row_id, row.is_chat, error_code=code.value, error_message=message,
                   passthrough=row.passthrough, line=row.line)
