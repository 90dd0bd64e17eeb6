"""Chat messages to prompt text: the tokenizer's chat template, or ChatML when it has none.

Messages are checked and normalized before the template sees them, so every template gets the same
simple shape: `{"role": str, "content": str, ...}`. Content may be a string, a list of OpenAI text parts
(`{"type": "text", "text": ...}`, joined with "\\n" as vLLM does) or null (an assistant message that only
calls tools: rendered as ""). Other parts (images, audio) are refused: the engine is text-only.

The rendered text places the template's special tokens itself; encode it with `add_special_tokens=False`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

# ChatML, as Qwen and many instruction-tuned models use it:
#   <|im_start|>{role}\n{content}<|im_end|>\n ... then <|im_start|>assistant\n for the reply.
# Used only when the tokenizer has no template of its own; the markers are plain text to a tokenizer that
# lacks them as special tokens, which still gives the model an unambiguous, consistent prompt.
DEFAULT_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
TEXT_PARTS_SEPARATOR = "\n"


class ChatTemplateError(ValueError):
    """The messages are invalid or the chat template failed on them; the message says why."""


def render_chat(tokenizer: Any, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                tools: list[dict[str, Any]] | None = None, **template_kwargs: Any) -> str:
    """The prompt text for `messages` (see the module docstring); raises ChatTemplateError.
    `tools`: functions in OpenAI's shape, for a template that renders them; `template_kwargs`: the
    template's own switches (`enable_thinking`, `reasoning_effort`)."""
    normalized = normalize_messages(messages)
    # None makes transformers use the tokenizer's own template (a named-template dict included).
    template = None if getattr(tokenizer, "chat_template", None) else DEFAULT_CHAT_TEMPLATE
    try:
        text = tokenizer.apply_chat_template(normalized, chat_template=template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt, tools=tools,
                                             **template_kwargs)
    except Exception as error:  # noqa: BLE001 - a template may raise anything (jinja, its own raise_exception)
        raise ChatTemplateError(f"the chat template failed on these messages: {error}") from None
    if not isinstance(text, str):
        raise ChatTemplateError(f"the chat template rendered {type(text).__name__}, not text")
    return text


def chat_token_ids(tokenizer: Any, messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """The prompt token ids of `messages`, ready for the reply (raises ChatTemplateError)."""
    return prompt_token_ids(tokenizer, render_chat(tokenizer, messages, add_generation_prompt=True))


def prompt_token_ids(tokenizer: Any, rendered: str) -> list[int]:
    """A rendered chat prompt's token ids: the template placed its special tokens itself."""
    return list(tokenizer.encode(rendered, add_special_tokens=False))


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Checked copies with string content; raises ChatTemplateError naming the message and the problem."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ChatTemplateError("messages must be a non-empty list of chat messages")
    normalized = []
    for position, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"messages[{position}] must be an object, got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ChatTemplateError(f"messages[{position}] needs a role (a non-empty string)")
        content = _content_text(message.get("content"), f"messages[{position}]")
        entry = {**message, "role": role, "content": content}
        if isinstance(message.get("tool_calls"), Sequence):
            entry["tool_calls"] = [_call_with_object_arguments(call) for call in message["tool_calls"]]
        normalized.append(entry)
    return normalized


def _call_with_object_arguments(call: Any) -> Any:
    """An earlier tool call with its arguments as an object: OpenAI sends them as JSON text, and
    templates write them with `tojson` (vLLM turns them into objects too)."""
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}


def _content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, Sequence) or isinstance(content, bytes):
        raise ChatTemplateError(f"{where}.content must be text or a list of text parts, "
                                f"got {type(content).__name__}")
    texts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ChatTemplateError(f"{where}.content[{index}] must be a text part "
                                    f"({{\"type\": \"text\", \"text\": ...}}); got type {kind!r}: "
                                    "this engine reads text only")
        texts.append(part["text"])
    return TEXT_PARTS_SEPARATOR.join(texts)
