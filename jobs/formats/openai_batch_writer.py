"""OpenAI Batch API output lines: `{"id", "custom_id", "response", "error"}`.

Completed rows carry `response.body` shaped like a `chat.completion` or `text_completion`
object with `usage` and one entry in `choices` per sample (`n`), each with vLLM's `stop_reason` (the
stop string or stop token id that ended it, else null) and its `logprobs` in OpenAI's shape when
the request asked (chat: `{"content": [{token, logprob, bytes, top_logprobs}]}`; completions:
`{tokens, token_logprobs, top_logprobs, text_offset}`, which with `echo` cover the prompt's tokens
first, the first one's logprob null, as the legacy API did). A chat answer that calls functions has
`message.tool_calls` (arguments as JSON text) and finish_reason `tool_calls`; a thinking model's
thinking is `message.reasoning_content` (vLLM's field) and its tokens
`usage.completion_tokens_details.reasoning_tokens`. Failed rows carry `response: null` and
`error: {code, message}`, except a row that produced text and then failed (its JSON or a call cut
off at max_tokens): it keeps its `response` (text, finish_reason, usage) beside the `error`.
An embed row's body is OpenAI's embeddings `list` (jobs/formats/embedding_writer.py).
Ids derive from the job and the custom_id, so a rerun writes the same ids.
"""

from __future__ import annotations

import codecs
import hashlib
import json
from typing import Any

from bulkinfer.jobs.formats.embedding_writer import embeddings_body
from bulkinfer.jobs.formats.output import Choice, OutputRow, PositionLogprobs, PromptLogprobs, TokenLogprob


def _stable_id(*parts: str) -> str:
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:24]


def openai_batch_record(row: OutputRow, *, job_id: str, model: str, created: int) -> dict[str, Any]:
    request_id = _stable_id(job_id, row.row_id)
    record: dict[str, Any] = {"id": f"batch_req_{request_id}", "custom_id": row.row_id}
    if row.failed and not row.choices:
        record["response"] = None
        record["error"] = {"code": row.error_code, "message": row.error_message}
        return record
    if row.embeddings is not None:
        body = embeddings_body(row, model)
    else:  # a row run on a LoRA adapter names it as its model, as vLLM's server does
        body = completion_body(row, request_id, row.lora or model, created)
    record["response"] = {"status_code": 200, "request_id": f"req_{request_id}", "body": body}
    # A row that produced text and still failed (JSON cut off at max_tokens, as OpenAI returns it with
    # finish_reason "length") keeps its response, and says why it failed.
    record["error"] = {"code": row.error_code, "message": row.error_message} if row.failed else None
    return record


def completion_body(row: OutputRow, request_id: str, model: str, created: int) -> dict[str, Any]:
    prompt_tokens = row.prompt_tokens or 0
    completion_tokens = row.completion_tokens or 0
    usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                             "total_tokens": prompt_tokens + completion_tokens,
                             "prompt_tokens_details": {"cached_tokens": row.cached_tokens or 0}}
    if row.reasoning_tokens:
        usage["completion_tokens_details"] = {"reasoning_tokens": row.reasoning_tokens}
    choices = row.choices or (Choice(0, row.text or "", row.finish_reason or "stop"),)
    if row.is_chat:
        return {"id": f"chatcmpl-{request_id}", "object": "chat.completion", "created": created,
                "model": model, "choices": [chat_choice(choice) for choice in choices], "usage": usage}
    return {"id": f"cmpl-{request_id}", "object": "text_completion", "created": created, "model": model,
            "choices": [completion_choice(choice, row) for choice in choices], "usage": usage}


def chat_choice(choice: Choice) -> dict[str, Any]:
    logprobs = None
    if choice.logprobs is not None:
        logprobs = {"content": [{**_chat_token(position.chosen),
                                 "top_logprobs": [_chat_token(entry) for entry in position.top]}
                                for position in choice.logprobs],
                    "refusal": None}
    message: dict[str, Any] = {"role": "assistant", "content": choice.text, "refusal": None}
    if choice.tool_calls:
        message["content"] = choice.text or None  # OpenAI's shape for an answer that only calls
        message["tool_calls"] = [{"id": call.id, "type": "function",
                                  "function": {"name": call.name,
                                               "arguments": json.dumps(call.arguments, ensure_ascii=False)}}
                                 for call in choice.tool_calls]
    if choice.reasoning is not None:
        message["reasoning_content"] = choice.reasoning  # vLLM's field for the thinking
    return {"index": choice.index, "message": message, "logprobs": logprobs,
            "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason}


def _chat_token(entry: TokenLogprob) -> dict[str, Any]:
    return {"token": entry.token, "logprob": entry.logprob, "bytes": entry.bytes}


def completion_choice(choice: Choice, row: OutputRow | None = None) -> dict[str, Any]:
    """One sample; with the row's `echo`, its text and logprobs start with the prompt's."""
    echo = row.echo_prompt if row is not None else None
    text = choice.text if echo is None else echo + choice.text
    logprobs = None
    if choice.logprobs is not None:
        prompt = row.prompt_logprobs if echo is not None and row is not None else None
        logprobs = completion_logprobs(choice.logprobs, prompt)
    return {"index": choice.index, "text": text, "logprobs": logprobs,
            "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason}


def completion_logprobs(positions: list[PositionLogprobs], prompt: PromptLogprobs | None = None
                        ) -> dict[str, Any]:
    """The legacy completions shape. `top_logprobs` maps token text to logprob: the top k plus the
    chosen token (OpenAI: "up to logprobs+1 elements"); tokens with the same text keep the likelier.
    `text_offset`: where each token starts in the text, in characters (a token that begins inside
    a multi-byte character gets that character's offset). `prompt` (echo): the prompt's tokens come
    first, the first with a null logprob and null top_logprobs (nothing precedes it)."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    token_bytes: list[list[int]] = []
    if prompt is not None:
        tokens.append(prompt.first_token)
        token_logprobs.append(None)
        top_logprobs.append(None)
        token_bytes.append(prompt.first_bytes)
        positions = [*prompt.positions, *positions]
    for position in positions:
        tokens.append(position.chosen.token)
        token_logprobs.append(position.chosen.logprob)
        top: dict[str, float] = {}
        for entry in [*position.top, position.chosen]:
            top.setdefault(entry.token, entry.logprob)
        top_logprobs.append(top)
    token_bytes.extend(position.chosen.bytes for position in positions)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offsets(token_bytes)}


def text_offsets(token_bytes: list[list[int]]) -> list[int]:
    """Character offset of each token in the text its bytes decode to."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    offsets, length = [], 0
    for data in token_bytes:
        offsets.append(length)
        length += len(decoder.decode(bytes(data)))
    return offsets
