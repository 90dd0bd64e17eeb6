"""Parquet output parts: flat columns that load straight into a warehouse table."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from jobs.formats.output import OutputRow

if TYPE_CHECKING:
    import pyarrow as pa


def output_table(rows: list[OutputRow], include_json: bool, passthrough_columns: list[str]) -> pa.Table:
    """Columns: id, text, [json (JSON text),] finish_reason, prompt/cached/completion_tokens,
    error_code, error, then the passthrough columns with the types pyarrow infers.
    """
    import pyarrow as pa

    columns: dict[str, pa.Array] = {
        "id": pa.array([row.row_id for row in rows], pa.string()),
        "text": pa.array([row.text for row in rows], pa.string()),
    }
    if include_json:
        # Outputs of one job may follow different schemas, so JSON stays text here.
        columns["json"] = pa.array([None if row.json_value is None else json.dumps(row.json_value)
                                    for row in rows], pa.string())
    columns["finish_reason"] = pa.array([row.finish_reason for row in rows], pa.string())
    for name in ("prompt_tokens", "cached_tokens", "completion_tokens"):
        columns[name] = pa.array([getattr(row, name) for row in rows], pa.int64())
    columns["error_code"] = pa.array([row.error_code for row in rows], pa.string())
    columns["error"] = pa.array([row.error_message for row in rows], pa.string())
    for name in passthrough_columns:
        columns[name] = _passthrough_array([row.passthrough.get(name) for row in rows])
    return pa.table(columns)


def _passthrough_array(values: list[object]) -> pa.Array:
    """The values with their inferred type; as JSON text when they share none (JSONL input can mix
    numbers and strings in one column), so one odd row never fails the part.
    """
    import pyarrow as pa

    try:
        return pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return pa.array([None if value is None else json.dumps(value, default=str) for value in values],
                        pa.string())
