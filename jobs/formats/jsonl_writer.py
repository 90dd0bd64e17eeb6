"""JSONL output lines and error-part lines."""

from __future__ import annotations

import json
from typing import Any

from bulkinfer.jobs.formats.output import Choice, OutputRow, PositionLogprobs


def jsonl_output_record(row: OutputRow, include_json: bool) -> dict[str, Any]:
    """`{"id", "text", ["json",] "finish_reason", ["logprobs",] ["choices",] "usage", "error", ...}`
    (then the passthrough columns).

    `text`, `json` and `finish_reason` are the first sample's. `logprobs` is there when the row asked
    for them: one `{token, token_id, logprob, bytes, top_logprobs: [...]}` per output token. `choices`
    is there when the row has more than one sample (`n` > 1): `{index, text, [json,] finish_reason,
    [logprobs]}` each, choice 0 included. `prompt_logprobs` is there when the row asked: null for the
    first prompt token, then one record (as in `logprobs`) per later prompt token. `reasoning` (a
    thinking model's thinking) and `tool_calls` (`[{id, name, arguments}]`) are there when the
    sample has them, and `usage.reasoning_tokens` when it thought.
    """
    record: dict[str, Any] = {"id": row.row_id, **_sample_fields(row, include_json)}
    if len(row.choices) > 1:
        record["choices"] = [choice_record(choice, include_json) for choice in row.choices]
    if row.prompt_logprobs is not None:
        record["prompt_logprobs"] = row.prompt_logprobs.as_records()
    record["usage"] = None if row.prompt_tokens is None else {
        "prompt_tokens": row.prompt_tokens, "cached_tokens": row.cached_tokens,
        "completion_tokens": row.completion_tokens}
    if record["usage"] is not None and row.reasoning_tokens:
        record["usage"]["reasoning_tokens"] = row.reasoning_tokens
    if record["usage"] is not None and row.lora is not None:  # the adapter these tokens ran on
        record["usage"]["lora"] = row.lora
    record["error"] = None if not row.failed else {"code": row.error_code, "message": row.error_message}
    record.update(row.passthrough)
    return record


def choice_record(choice: Choice, include_json: bool) -> dict[str, Any]:
    return {"index": choice.index, **_sample_fields(choice, include_json)}


def _sample_fields(sample: Choice | OutputRow, include_json: bool) -> dict[str, Any]:
    """`text`, [`json`,] `finish_reason`, [`logprobs`]: of a choice, or of a row's first sample."""
    fields: dict[str, Any] = {"text": sample.text}
    if include_json:
        fields["json"] = sample.json_value
    if sample.reasoning is not None:
        fields["reasoning"] = sample.reasoning
    if sample.tool_calls:
        fields["tool_calls"] = [call.as_record() for call in sample.tool_calls]
    fields["finish_reason"] = sample.finish_reason
    if sample.logprobs is not None:
        fields["logprobs"] = logprobs_records(sample.logprobs)
    return fields


def logprobs_records(positions: list[PositionLogprobs]) -> list[dict[str, Any]]:
    return [position.as_record() for position in positions]


def error_record(row: OutputRow) -> dict[str, Any]:
    """A line of `errors/part-NNNNN.jsonl`: which row failed, and why (`line`: within the shard)."""
    return {"id": row.row_id, "index": row.index, "line": row.line,
            "error": {"code": row.error_code, "message": row.error_message}}


def dumps_line(record: dict[str, Any]) -> bytes:
    # default=str: passthrough values such as dates and decimals become text instead of failing.
    return json.dumps(record, ensure_ascii=False, separators=(",", ":"), default=str).encode() + b"\n"
