"""Anthropic Messages requests in an OpenAI-batch file: lines with `"url": "/v1/messages"`.

Their `body` is a Messages request (`params` of an Anthropic batch request), turned into a chat
`Row`: `system` (a string or text blocks) becomes a leading system message, each message's content
(a string or text blocks, joined as the chat renderer joins text parts), `max_tokens` (required),
`temperature`, `top_p`, `top_k` and `stop_sequences` (→ `stop`) map onto the sampling knobs, and
`metadata` / `service_tier` change nothing. A batch runs one base model: `model` names the job's, or a
LoRA adapter registered on it (that request then runs on the adapter).
What we cannot serve (tools, images and documents, thinking, streaming, a prefilled assistant turn,
any field we do not know) is that request's error naming it, never the job's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from bulkinfer.jobs.formats.rows import (
    Row,
    RowErrorCode,
    RowProblem,
    first_error_message,
    parse_sampling_overrides,
    requested_adapter,
    with_instructions_messages,
)
from bulkinfer.jobs.spec import JobSpec
from bulkinfer.jobs.tokenizer_files import TEXT_PARTS_SEPARATOR

MESSAGES_URL = "/v1/messages"
WHERE = "params"  # how an Anthropic user names the request: a batch request's `params`
# Messages fields → our sampling knobs.
SAMPLING_FIELDS = {"max_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p",
                   "top_k": "top_k"}
# Fields that change nothing here: `metadata.user_id` is for Anthropic's abuse checks; a batch has one tier.
IGNORED_FIELDS = frozenset({"model", "metadata", "service_tier"})
REQUEST_FIELDS = frozenset({"messages", "system", "stop_sequences", "stream"})
KNOWN_FIELDS = frozenset(SAMPLING_FIELDS) | IGNORED_FIELDS | REQUEST_FIELDS
# Known Messages fields we do not serve, and why (any other unknown field gets the generic message).
NOT_SERVED = {
    "tools": "tool use is not supported by this server",
    "tool_choice": "tool use is not supported by this server",
    "thinking": "extended thinking is not supported by this server",
    "mcp_servers": "MCP servers are not supported by this server",
    "container": "containers (code execution) are not supported by this server",
}
ROLES = ("user", "assistant")


class AnthropicMessagesRowBuilder:
    """Builds the chat `Row` of one `/v1/messages` line (raises `RowProblem` for what cannot run)."""

    def __init__(self, spec: JobSpec, default_response_format: dict[str, Any] | None) -> None:
        self.spec = spec
        self.default_response_format = default_response_format

    def row(self, index: int, custom_id: str, params: dict[str, Any], line: int | None) -> Row:
        _refuse_unserved(params)
        lora = _requested_adapter(params.get("model"), self.spec.model)
        messages = _messages(params.get("messages"))
        if params.get("system") is not None:
            messages = [{"role": "system", "content": _text(params["system"], f"{WHERE}.system")}, *messages]
        messages = with_instructions_messages(self.spec.instructions, messages)
        try:
            sampling = self.spec.sampling.merged(_sampling_overrides(params))
        except ValidationError as error:
            message = f"{WHERE}: {first_error_message(error)}"
            raise RowProblem(RowErrorCode.INVALID_SAMPLING, message) from None
        return Row(index, custom_id, None, messages, sampling, self.default_response_format, {}, line,
                   lora=lora, lora_names_model=True)


def _refuse_unserved(params: dict[str, Any]) -> None:
    for name in sorted(params):
        if name in NOT_SERVED:
            raise RowProblem(RowErrorCode.INVALID_ROW, f"{WHERE}.{name}: {NOT_SERVED[name]}")
        if name not in KNOWN_FIELDS:
            raise RowProblem(RowErrorCode.INVALID_ROW, f"{WHERE}.{name} is not supported here")
    if params.get("stream") not in (None, False):
        raise RowProblem(RowErrorCode.INVALID_ROW, f"{WHERE}.stream: a batch request cannot stream")


def _requested_adapter(model: Any, job_model: str) -> str | None:
    """None for the batch's model; another name must be an alias of it or a LoRA adapter registered on
    it (the worker checks, and makes any other name this request's `unknown_model` error, or
    `unknown_lora` for an adapter of another model)."""
    if model is None:
        raise RowProblem(RowErrorCode.INVALID_ROW, f"{WHERE}.model is required")
    if model == job_model:
        return None
    return requested_adapter(model, f"{WHERE}.model")


def _messages(value: Any) -> list[dict[str, Any]]:
    where = f"{WHERE}.messages"
    if not isinstance(value, list) or not value:
        raise RowProblem(RowErrorCode.INVALID_ROW, f"{where} must be a non-empty list of messages")
    messages = []
    for position, message in enumerate(value):
        role = message.get("role") if isinstance(message, Mapping) else None
        if role not in ROLES:
            raise RowProblem(RowErrorCode.INVALID_ROW,
                             f"{where}[{position}].role must be 'user' or 'assistant' (the system prompt "
                             f"goes in {WHERE}.system)")
        if message.get("content") is None:
            raise RowProblem(RowErrorCode.INVALID_ROW, f"{where}[{position}] has no content")
        messages.append({"role": role, "content": _text(message["content"], f"{where}[{position}].content")})
    if messages[-1]["role"] == "assistant":
        # The chat template opens a new assistant turn: we cannot continue the given one.
        raise RowProblem(RowErrorCode.INVALID_ROW,
                         f"{where} ends with an assistant message (a prefill to continue), which is not "
                         "supported here; end with a user message")
    return messages


def _text(content: Any, where: str) -> str:
    """A string, or text blocks joined as the chat renderer joins text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RowProblem(RowErrorCode.INVALID_ROW, f"{where} must be a string or a list of text blocks")
    texts = []
    for position, block in enumerate(content):
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind != "text":
            described = f"a block of type {kind!r}" if isinstance(kind, str) else "not a content block"
            raise RowProblem(RowErrorCode.INVALID_ROW,
                             f"{where}[{position}] is {described}: only text blocks are supported here")
        if not isinstance(block.get("text"), str):
            raise RowProblem(RowErrorCode.INVALID_ROW, f"{where}[{position}].text must be a string")
        texts.append(block["text"])  # cache_control needs nothing: prefixes are cached automatically
    return TEXT_PARTS_SEPARATOR.join(texts)


def _sampling_overrides(params: dict[str, Any]) -> dict[str, Any]:
    max_tokens = params.get("max_tokens")
    if max_tokens is None:
        raise RowProblem(RowErrorCode.INVALID_SAMPLING, f"{WHERE}.max_tokens is required")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise RowProblem(RowErrorCode.INVALID_SAMPLING,
                         f"{WHERE}.max_tokens must be an integer of at least 1")
    overrides = {ours: params[theirs] for theirs, ours in SAMPLING_FIELDS.items()
                 if params.get(theirs) is not None}
    stop = params.get("stop_sequences")
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(item, str) and item for item in stop):
            raise RowProblem(RowErrorCode.INVALID_SAMPLING,
                             f"{WHERE}.stop_sequences must be a list of non-empty strings")
        if stop:
            overrides["stop"] = stop
    return parse_sampling_overrides(overrides, WHERE)
