"""Anthropic Messages requests in an OpenAI-batch file: lines with `"url": "/v1/messages"`.

Their `body` is a Messages request (`params` of an Anthropic batch request), turned into a chat
`Row`: `system` (a string or text blocks) becomes a leading system message, each message's content
(a string or text blocks, joined as the chat renderer joins text parts), `max_tokens` (required),
`temperature`, `top_p`, `top_k` and `stop_sequences` (→ `stop`) map onto the sampling knobs, and
`metadata` / `service_tier` change nothing. A batch runs one base model: `model` names the job's, or a
LoRA adapter registered on it (that request then runs on the adapter).
`tools` and `tool_choice` offer functions (jobs/tool_calls.py); earlier turns may carry `tool_use`
blocks (an assistant's calls) and `tool_result` blocks (a user turn's answers to them), rendered as
the chat template renders OpenAI's `tool_calls` and `tool` messages; `thinking` turns a thinking
model's thinking on and returns it as `thinking` blocks (earlier turns' thinking blocks are dropped,
as Anthropic's API drops them). `image` blocks in a user turn (a `base64` or `url` source) become
`image_url` parts (jobs/formats/image_parts.py), and that turn's content stays a list of parts in
order, its text blocks as text parts. What we cannot serve (server tools, documents, images from the
Files API, streaming, a prefilled assistant turn, any field we do not know) is that request's error
naming it, never the job's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from bulkinfer.jobs.formats.image_parts import (
    ImagePartError,
    check_image_count,
    checked_url,
    image_part,
    text_part,
)
from bulkinfer.jobs.formats.rows import (
    Row,
    RowErrorCode,
    RowProblem,
    first_error_message,
    parse_sampling_overrides,
    requested_adapter,
    with_instructions_messages,
)
from bulkinfer.jobs.image_limits import ImageLimits
from bulkinfer.jobs.spec import JobSpec
from bulkinfer.jobs.tokenizer_files import TEXT_PARTS_SEPARATOR
from bulkinfer.jobs.tool_calls import ToolProblem, anthropic_thinking, anthropic_tool_request

MESSAGES_URL = "/v1/messages"
WHERE = "params"  # how an Anthropic user names the request: a batch request's `params`
# Messages fields → our sampling knobs.
SAMPLING_FIELDS = {"max_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p",
                   "top_k": "top_k"}
# Fields that change nothing here: `metadata.user_id` is for Anthropic's abuse checks; a batch has one tier.
IGNORED_FIELDS = frozenset({"model", "metadata", "service_tier"})
REQUEST_FIELDS = frozenset({"messages", "system", "stop_sequences", "stream", "tools", "tool_choice",
                            "thinking"})
KNOWN_FIELDS = frozenset(SAMPLING_FIELDS) | IGNORED_FIELDS | REQUEST_FIELDS
# Known Messages fields we do not serve, and why (any other unknown field gets the generic message).
NOT_SERVED = {
    "mcp_servers": "MCP servers are not supported by this server",
    "container": "containers (code execution) are not supported by this server",
}
ROLES = ("user", "assistant")
IMAGE_SOURCES = ("base64", "url")


class AnthropicMessagesRowBuilder:
    """Builds the chat `Row` of one `/v1/messages` line (raises `RowProblem` for what cannot run)."""

    def __init__(self, spec: JobSpec, default_response_format: dict[str, Any] | None, *,
                 limits: ImageLimits | None = None) -> None:
        self.spec = spec
        self.default_response_format = default_response_format
        self.limits = limits or ImageLimits()

    def row(self, index: int, custom_id: str, params: dict[str, Any], line: int | None) -> Row:
        _refuse_unserved(params)
        lora = _requested_adapter(params.get("model"), self.spec.model)
        try:
            messages = _messages(params.get("messages"), self.limits)
            check_image_count(messages, self.limits)
        except ImagePartError as error:
            raise RowProblem.of_image(error) from None
        if params.get("system") is not None:
            messages = [{"role": "system", "content": _text(params["system"], f"{WHERE}.system")}, *messages]
        messages = with_instructions_messages(self.spec.instructions, messages)
        try:
            tools = anthropic_tool_request(params)
            thinking = anthropic_thinking(params)
        except ToolProblem as problem:
            raise RowProblem(RowErrorCode.INVALID_ROW, str(problem)) from None
        try:
            sampling = self.spec.sampling.merged(_sampling_overrides(params))
        except ValidationError as error:
            message = f"{WHERE}: {first_error_message(error)}"
            raise RowProblem(RowErrorCode.INVALID_SAMPLING, message) from None
        return Row(index, custom_id, None, messages, sampling, self.default_response_format, {}, line,
                   lora=lora, lora_names_model=True, tools=tools, template_kwargs=thinking.template_kwargs,
                   hide_reasoning=not thinking.shown, thinking_budget=thinking.budget)


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


def _messages(value: Any, limits: ImageLimits) -> list[dict[str, Any]]:
    where = f"{WHERE}.messages"
    if not isinstance(value, list) or not value:
        raise RowProblem(RowErrorCode.INVALID_ROW, f"{where} must be a non-empty list of messages")
    messages: list[dict[str, Any]] = []
    for position, message in enumerate(value):
        role = message.get("role") if isinstance(message, Mapping) else None
        if role not in ROLES:
            raise RowProblem(RowErrorCode.INVALID_ROW,
                             f"{where}[{position}].role must be 'user' or 'assistant' (the system prompt "
                             f"goes in {WHERE}.system)")
        if message.get("content") is None:
            raise RowProblem(RowErrorCode.INVALID_ROW, f"{where}[{position}] has no content")
        messages.extend(_turn(role, message["content"], f"{where}[{position}].content", limits))
    if value[-1]["role"] == "assistant":
        # The chat template opens a new assistant turn: we cannot continue the given one.
        raise RowProblem(RowErrorCode.INVALID_ROW,
                         f"{where} ends with an assistant message (a prefill to continue), which is not "
                         "supported here; end with a user message")
    return messages


def _turn(role: str, content: Any, where: str, limits: ImageLimits) -> list[dict[str, Any]]:
    """One Anthropic turn as chat messages: an assistant's text and `tool_use` calls as one message
    with OpenAI's `tool_calls`; a user's `tool_result` blocks as `tool` messages, then its text (with
    images: its text and image blocks as parts, in order)."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise RowProblem(RowErrorCode.INVALID_ROW, f"{where} must be a string or a list of content blocks")
    texts: list[str] = []
    parts: list[dict[str, Any]] = []  # the user's text and images in order
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for position, block in enumerate(content):
        kind = block.get("type") if isinstance(block, Mapping) else None
        here = f"{where}[{position}]"
        if kind == "text":
            texts.append(_block_text(block, here))
            parts.append(text_part(texts[-1]))
        elif kind == "image" and role == "user":
            parts.append(_image(block, here, limits))
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # earlier turns' thinking is not shown to the model again
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_use(block, here))
        elif kind == "tool_result" and role == "user":
            results.append(_tool_result(block, here))
        else:
            described = f"a block of type {kind!r}" if isinstance(kind, str) else "not a content block"
            allowed = "text and tool_use blocks are supported in an assistant turn" if role == "assistant" \
                else "text, image and tool_result blocks are supported in a user turn"
            raise RowProblem(RowErrorCode.INVALID_ROW, f"{here} is {described}: only {allowed}")
    text = TEXT_PARTS_SEPARATOR.join(texts)
    if role == "assistant":
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = calls
        return [message]
    if len(parts) > len(texts):  # images: the turn's blocks as parts, in order
        return [*results, {"role": "user", "content": parts}]
    return [*results, *([{"role": "user", "content": text}] if texts or not results else [])]


def _image(block: Mapping[str, Any], where: str, limits: ImageLimits) -> dict[str, Any]:
    """An image block as an `image_url` part: base64 data as a data: URL, a url source as it is."""
    source = block.get("source")
    if not isinstance(source, Mapping):
        raise RowProblem(RowErrorCode.INVALID_ROW, f"{where}.source must be an object")
    kind = source.get("type")
    if kind not in IMAGE_SOURCES:
        described = repr(kind) if isinstance(kind, str) else "missing"
        raise RowProblem(RowErrorCode.INVALID_ROW, f"{where}.source.type {described} is not supported here: "
                         "give the image as base64 data or a url")
    try:
        if kind == "url":
            url = source.get("url")
            if not isinstance(url, str):
                raise RowProblem(RowErrorCode.INVALID_ROW, f"{where}.source.url must be a string")
            return image_part(checked_url(url, f"{where}.source.url", limits))
        media_type, data = source.get("media_type"), source.get("data")
        if not isinstance(media_type, str) or not media_type.startswith("image/"):
            raise RowProblem(RowErrorCode.INVALID_ROW, f"{where}.source.media_type must be an image type "
                             "such as image/png")
        if not isinstance(data, str) or not data:
            raise RowProblem(RowErrorCode.INVALID_ROW, f"{where}.source.data must be base64 text")
        return image_part(checked_url(f"data:{media_type};base64,{data}", f"{where}.source", limits))
    except ImagePartError as error:
        raise RowProblem.of_image(error) from None


def _tool_use(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
        raise RowProblem(RowErrorCode.INVALID_ROW, f"{where} needs an id and a name")
    arguments = block.get("input")
    if not isinstance(arguments, Mapping):
        raise RowProblem(RowErrorCode.INVALID_ROW, f"{where}.input must be an object")
    function = {"name": block["name"], "arguments": dict(arguments)}
    return {"id": block["id"], "type": "function", "function": function}


def _tool_result(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(block.get("tool_use_id"), str):
        raise RowProblem(RowErrorCode.INVALID_ROW, f"{where}.tool_use_id must be a string")
    content = block.get("content")
    text = "" if content is None else _text(content, f"{where}.content")
    if block.get("is_error"):
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": text}


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
        texts.append(_block_text(block, f"{where}[{position}]"))
    return TEXT_PARTS_SEPARATOR.join(texts)


def _block_text(block: Mapping[str, Any], where: str) -> str:
    if not isinstance(block.get("text"), str):
        raise RowProblem(RowErrorCode.INVALID_ROW, f"{where}.text must be a string")
    return block["text"]  # cache_control needs nothing: prefixes are cached automatically


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
