"""OpenAI Batch API output lines: `{"id", "custom_id", "response", "error"}`.

Completed rows carry `response.body` shaped like a `chat.completion` or `text_completion`
object with `usage`; failed rows carry `response: null` and `error: {code, message}`.
Ids derive from the job and the custom_id, so a rerun writes the same ids.
"""

from __future__ import annotations

import hashlib
from typing import Any

from jobs.formats.output import OutputRow


def _stable_id(*parts: str) -> str:
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:24]


def openai_batch_record(row: OutputRow, *, job_id: str, model: str, created: int) -> dict[str, Any]:
    request_id = _stable_id(job_id, row.row_id)
    record: dict[str, Any] = {"id": f"batch_req_{request_id}", "custom_id": row.row_id}
    if row.failed:
        record["response"] = None
        record["error"] = {"code": row.error_code, "message": row.error_message}
        return record
    record["response"] = {"status_code": 200, "request_id": f"req_{request_id}",
                          "body": completion_body(row, request_id, model, created)}
    record["error"] = None
    return record


def completion_body(row: OutputRow, request_id: str, model: str, created: int) -> dict[str, Any]:
    prompt_tokens = row.prompt_tokens or 0
    completion_tokens = row.completion_tokens or 0
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens,
             "prompt_tokens_details": {"cached_tokens": row.cached_tokens or 0}}
    if row.is_chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": row.text, "refusal": None},
                  "logprobs": None, "finish_reason": row.finish_reason}
        return {"id": f"chatcmpl-{request_id}", "object": "chat.completion", "created": created,
                "model": model, "choices": [choice], "usage": usage}
    choice = {"index": 0, "text": row.text, "logprobs": None, "finish_reason": row.finish_reason}
    return {"id": f"cmpl-{request_id}", "object": "text_completion", "created": created, "model": model,
            "choices": [choice], "usage": usage}
