"""JSONL output lines and error-part lines."""

from __future__ import annotations

import json
from typing import Any

from jobs.formats.output import OutputRow


def jsonl_output_record(row: OutputRow, include_json: bool) -> dict[str, Any]:
    """`{"id", "text", ["json",] "finish_reason", "usage", "error", <passthrough columns>}`."""
    record: dict[str, Any] = {"id": row.row_id, "text": row.text}
    if include_json:
        record["json"] = row.json_value
    record["finish_reason"] = row.finish_reason
    record["usage"] = None if row.prompt_tokens is None else {
        "prompt_tokens": row.prompt_tokens, "cached_tokens": row.cached_tokens,
        "completion_tokens": row.completion_tokens}
    record["error"] = None if not row.failed else {"code": row.error_code, "message": row.error_message}
    record.update(row.passthrough)
    return record


def error_record(row: OutputRow) -> dict[str, Any]:
    """A line of `errors/part-NNNNN.jsonl`: which row failed, and why (`line`: within the shard)."""
    return {"id": row.row_id, "index": row.index, "line": row.line,
            "error": {"code": row.error_code, "message": row.error_message}}


def dumps_line(record: dict[str, Any]) -> bytes:
    # default=str: passthrough values such as dates and decimals become text instead of failing.
    return json.dumps(record, ensure_ascii=False, separators=(",", ":"), default=str).encode() + b"\n"
