"""Parquet output parts: flat columns that load straight into a warehouse table.

Which columns a part has is decided per job (never per part), so every part of a job has the same
schema: `json` when the job asks for JSON, `logprobs` when any row may ask for logprobs, `choices`
when any row may ask for more than one sample, `prompt_logprobs` when any row may score its prompt
(see `may_have_logprobs` / `may_have_choices` / `may_have_prompt_logprobs`).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from bulkinfer.jobs.formats.output import Choice, OutputRow, PositionLogprobs, TokenLogprob
from bulkinfer.jobs.spec import InputFormat, JobSpec

if TYPE_CHECKING:
    import pyarrow as pa


def may_have_choices(spec: JobSpec) -> bool:
    """Whether a row of this job can have n > 1 samples (per-row overrides and OpenAI bodies can)."""
    return bool((spec.sampling.n or 1) > 1 or spec.sampling_column
                or spec.input_format == InputFormat.OPENAI_BATCH)


def may_have_logprobs(spec: JobSpec) -> bool:
    """Whether a row of this job can ask for logprobs."""
    return bool(spec.sampling.logprobs is not None or spec.sampling_column
                or spec.input_format == InputFormat.OPENAI_BATCH)


def may_have_prompt_logprobs(spec: JobSpec) -> bool:
    """Whether a row of this job can ask for prompt_logprobs."""
    return bool(spec.sampling.prompt_logprobs is not None or spec.sampling_column
                or spec.input_format == InputFormat.OPENAI_BATCH)


def may_have_lora(spec: JobSpec) -> bool:
    """Whether a row of this job can run on a LoRA adapter (and so has a `lora` column)."""
    return bool(spec.lora or spec.lora_column)


def may_have_tool_calls(spec: JobSpec) -> bool:
    """Whether a row of this job can offer tools (the job's, or an OpenAI line's own)."""
    return bool(spec.tools or spec.input_format == InputFormat.OPENAI_BATCH)


def may_have_reasoning(spec: JobSpec) -> bool:
    """Whether a row of this job can run as chat, where a thinking model's thinking comes apart."""
    return bool(spec.messages_column or spec.apply_chat_template is not False
                or spec.input_format == InputFormat.OPENAI_BATCH)


def output_table(rows: list[OutputRow], include_json: bool, passthrough_columns: list[str], *,
                 include_logprobs: bool = False, include_choices: bool = False,
                 include_prompt_logprobs: bool = False, include_lora: bool = False,
                 include_tool_calls: bool = False, include_reasoning: bool = False) -> pa.Table:
    """Columns: id, text, [json (JSON text),] [reasoning,] [tool_calls,] finish_reason, [logprobs,]
    [choices,] [prompt_logprobs,] prompt/cached/completion_tokens, [reasoning_tokens,] [lora (the
    adapter the row ran on, null: the base),] error_code, error, then the passthrough columns with
    the types pyarrow infers. `reasoning`: a thinking model's thinking (null: none); `tool_calls`:
    the calls as JSON text, `[{id, name, arguments}]` (null: none).

    `text`, `json`, `finish_reason` and `logprobs` are the first sample's. `logprobs`: a list per row
    (null when the row did not ask) of structs `{token, token_id, logprob, bytes (binary),
    top_logprobs: list<{token, token_id, logprob, bytes}>}`. `choices`: every sample of a completed row
    as structs `{index, text, json, finish_reason, logprobs}`. `prompt_logprobs`: as `logprobs`, one
    per prompt token, the first null (nothing precedes it); the column is null where a row did not ask.
    """
    import pyarrow as pa

    columns: dict[str, pa.Array] = {
        "id": pa.array([row.row_id for row in rows], pa.string()),
        "text": pa.array([row.text for row in rows], pa.string()),
    }
    if include_json:
        # Outputs of one job may follow different schemas, so JSON stays text here.
        columns["json"] = pa.array([_json_text(row.json_value) for row in rows], pa.string())
    if include_reasoning:
        columns["reasoning"] = pa.array([row.reasoning for row in rows], pa.string())
    if include_tool_calls:
        columns["tool_calls"] = pa.array([_json_text([call.as_record() for call in row.tool_calls])
                                          if row.tool_calls else None for row in rows], pa.string())
    columns["finish_reason"] = pa.array([row.finish_reason for row in rows], pa.string())
    if include_logprobs:
        columns["logprobs"] = pa.array([_logprobs_value(row.logprobs) for row in rows], _logprobs_type())
    if include_choices:
        columns["choices"] = pa.array([[_choice_value(choice) for choice in row.choices] or None
                                       for row in rows], pa.list_(_choice_type()))
    if include_prompt_logprobs:
        columns["prompt_logprobs"] = pa.array([_prompt_logprobs_value(row) for row in rows], _logprobs_type())
    for name in ("prompt_tokens", "cached_tokens", "completion_tokens"):
        columns[name] = pa.array([getattr(row, name) for row in rows], pa.int64())
    if include_reasoning:
        spent = [row.reasoning_tokens if row.prompt_tokens is not None else None for row in rows]
        columns["reasoning_tokens"] = pa.array(spent, pa.int64())
    if include_lora:
        columns["lora"] = pa.array([row.lora for row in rows], pa.string())
    columns["error_code"] = pa.array([row.error_code for row in rows], pa.string())
    columns["error"] = pa.array([row.error_message for row in rows], pa.string())
    for name in passthrough_columns:
        columns[name] = _passthrough_array([row.passthrough.get(name) for row in rows])
    return pa.table(columns)


def _json_text(value: Any) -> str | None:
    return None if value is None else json.dumps(value)


def _token_type() -> pa.DataType:
    import pyarrow as pa

    return pa.struct([("token", pa.string()), ("token_id", pa.int64()), ("logprob", pa.float64()),
                      ("bytes", pa.binary())])


def _logprobs_type() -> pa.DataType:
    import pyarrow as pa

    position = pa.struct([*_token_type(), ("top_logprobs", pa.list_(_token_type()))])
    return pa.list_(position)


def _choice_type() -> pa.DataType:
    import pyarrow as pa

    return pa.struct([("index", pa.int32()), ("text", pa.string()), ("json", pa.string()),
                      ("finish_reason", pa.string()), ("logprobs", _logprobs_type())])


def _token_value(entry: TokenLogprob) -> dict[str, Any]:
    return {"token": entry.token, "token_id": entry.token_id, "logprob": entry.logprob,
            "bytes": bytes(entry.bytes)}


def _logprobs_value(positions: list[PositionLogprobs] | None) -> list[dict[str, Any]] | None:
    if positions is None:
        return None
    return [{**_token_value(position.chosen), "top_logprobs": [_token_value(entry) for entry in position.top]}
            for position in positions]


def _prompt_logprobs_value(row: OutputRow) -> list[dict[str, Any] | None] | None:
    if row.prompt_logprobs is None:
        return None
    return [None, *_logprobs_value(row.prompt_logprobs.positions)]  # type: ignore[misc]


def _choice_value(choice: Choice) -> dict[str, Any]:
    return {"index": choice.index, "text": choice.text, "json": _json_text(choice.json_value),
            "finish_reason": choice.finish_reason, "logprobs": _logprobs_value(choice.logprobs)}


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
