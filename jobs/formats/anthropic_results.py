"""One OpenAI-batch output record → one Anthropic Message Batches result line.

An Anthropic batch runs as an OpenAI-batch job of `/v1/messages` lines
(`jobs/formats/anthropic_messages.py`); its results are the job's output records
(`jobs/formats/openai_batch_writer.openai_batch_record`) in Anthropic's shape,
`{"custom_id", "result": {...}}` (the SDK's `MessageBatchIndividualResponse`):

- a completed request → `succeeded` with a `Message`: a `thinking` block when the request asked for
  thinking and the model thought, a text block (left out when the answer only calls functions), a
  `tool_use` block per call; `stop_reason` `tool_use` (it called), `end_turn` (EOS or a stop
  token), `stop_sequence` (one of the stop strings matched: vLLM's `stop_reason` in the choice) or
  `max_tokens`, and `usage` counted as Anthropic does (`input_tokens` excludes the prompt tokens
  read from the prefix cache, which are `cache_read_input_tokens`; `output_tokens` includes the
  thinking's);
- a failed one → `errored`, `invalid_request_error` for what the request itself got wrong and
  `api_error` for our failures (the engine's, a crashed worker);
- one the job's deadline caught → `expired`; one a cancel kept from running → `canceled`.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from bulkinfer.jobs.formats.rows import RowErrorCode

# Failures that are ours, not the request's: Anthropic's `api_error` ("an unexpected error
# internal to Anthropic's systems"). A code not known here is treated as ours too.
INTERNAL_ERRORS = frozenset(code.value for code in (RowErrorCode.ENGINE_ERROR, RowErrorCode.WORKER_CRASHED,
                                                    RowErrorCode.INVALID_OUTPUT_JSON))
REQUEST_ERRORS = frozenset(code.value for code in RowErrorCode) - INTERNAL_ERRORS - {RowErrorCode.EXPIRED}
RECORD_ID_PREFIX = "batch_req_"


def anthropic_result(record: dict[str, Any], model: str) -> dict[str, Any]:
    """The Anthropic result line of one OpenAI-batch output record of a job running `model`."""
    custom_id = record["custom_id"]
    error = record.get("error")
    if record.get("response") is None or error is not None:
        return {"custom_id": custom_id, "result": _failed(error or {})}
    body = record["response"]["body"]
    return {"custom_id": custom_id, "result": {"type": "succeeded",
                                               "message": _message(record["id"], body, model)}}


def canceled_result(custom_id: str) -> dict[str, Any]:
    """The result of a request the batch's cancel kept from running."""
    return {"custom_id": custom_id, "result": {"type": "canceled"}}


def expired_result(custom_id: str) -> dict[str, Any]:
    """The result of a request the batch's deadline caught before it ran."""
    return {"custom_id": custom_id, "result": {"type": "expired"}}


def error_type(code: str | None) -> str:
    """Anthropic's error type for one of our row error codes."""
    return "invalid_request_error" if code in REQUEST_ERRORS else "api_error"


def _failed(error: dict[str, Any]) -> dict[str, Any]:
    code = error.get("code")
    if code == RowErrorCode.EXPIRED:
        return {"type": "expired"}
    message = error.get("message") or f"the request failed ({code})"
    return {"type": "errored",
            "error": {"type": "error", "error": {"type": error_type(code), "message": message}}}


def _message(record_id: str, body: dict[str, Any], model: str) -> dict[str, Any]:
    choice = body["choices"][0]
    message = choice.get("message") or {}
    text = message["content"] if "message" in choice else choice.get("text")
    stop_reason, stop_sequence = _stop(choice.get("finish_reason"), choice.get("stop_reason"))
    usage = body.get("usage") or {}
    prompt_tokens = usage.get("prompt_tokens") or 0
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"id": f"msg_{record_id.removeprefix(RECORD_ID_PREFIX)}", "type": "message", "role": "assistant",
            "model": body.get("model") or model, "content": _content(message, text),
            "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": {"input_tokens": prompt_tokens - cached,
                      "output_tokens": usage.get("completion_tokens") or 0,
                      "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}}


def _content(message: dict[str, Any], text: str | None) -> list[dict[str, Any]]:
    """The Message's content blocks: thinking, text, then one `tool_use` per call."""
    blocks: list[dict[str, Any]] = []
    thinking = message.get("reasoning_content")
    if thinking is not None:
        # Anthropic signs thinking so it can be sent back verbatim; ours is a digest of the text.
        signature = hashlib.sha256(thinking.encode("utf-8", "surrogatepass")).hexdigest()
        blocks.append({"type": "thinking", "thinking": thinking, "signature": signature})
    calls = message.get("tool_calls") or []
    if text or not calls:
        blocks.append({"type": "text", "text": text or ""})
    for call in calls:
        function = call["function"]
        blocks.append({"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"),
                       "name": function["name"], "input": json.loads(function["arguments"])})
    return blocks


def _stop(finish_reason: str | None, matched: str | int | None) -> tuple[str, str | None]:
    """Anthropic's `stop_reason` and `stop_sequence` from the choice's finish_reason and vLLM
    stop_reason (a stop string, a stop token id, or null at EOS)."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "tool_calls":
        return "tool_use", None
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None
