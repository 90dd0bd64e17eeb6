"""Chat messages to prompt text: the tokenizer's chat template, or ChatML when it has none.

Messages are checked and normalized before the template sees them, so every template gets the same
simple shape: `{"role": str, "content": str, ...}`. Content may be a string, a list of OpenAI text parts
(`{"type": "text", "text": ...}`, joined with "\\n" as vLLM does) or null (an assistant message that only
calls tools: rendered as ""). Image parts (OpenAI's `image_url`, or `{"type": "image", "image": ...}`)
become `{"type": "image"}` parts, where the template writes its image placeholder; a message with one
keeps its content as a list of parts, as does every message for a template that only reads lists
(SmolVLM's). `chat_images` gives the images, in the order the placeholders are written. Audio and
other parts are refused.

The rendered text places the template's special tokens itself; encode it with `add_special_tokens=False`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bulkinfer.chat_content import (
    IMAGE_PART_TYPES,
    ContentError,
    template_content,
    template_reads_parts,
)

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


class ChatTemplateError(ValueError):
    """The messages are invalid or the chat template failed on them; the message says why."""


def render_chat(tokenizer: Any, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                tools: list[dict[str, Any]] | None = None, **template_kwargs: Any) -> str:
    """The prompt text for `messages` (see the module docstring); raises ChatTemplateError.
    `tools`: functions in OpenAI's shape, for a template that renders them; `template_kwargs`: the
    template's own switches (`enable_thinking`, `reasoning_effort`)."""
    own = getattr(tokenizer, "chat_template", None)
    as_parts = template_reads_parts(own if isinstance(own, str) else None)
    chat_images(messages)  # every image part has its image
    normalized = normalize_messages(messages, as_parts=as_parts)
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


def normalize_messages(messages: Sequence[Mapping[str, Any]], as_parts: bool = False) -> list[dict[str, Any]]:
    """Checked copies, content as a string (a list of parts where it holds an image, or for every
    message with `as_parts`); raises ChatTemplateError naming the message and the problem."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ChatTemplateError("messages must be a non-empty list of chat messages")
    normalized = []
    for position, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"messages[{position}] must be an object, got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ChatTemplateError(f"messages[{position}] needs a role (a non-empty string)")
        try:
            content = template_content(message.get("content"), f"messages[{position}]", as_parts)
        except ContentError as error:
            raise ChatTemplateError(str(error)) from None
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


@dataclass(frozen=True)
class ChatImage:
    """An image part's image: a URL or path (`data:`, a file, `s3://`...) or an image object, and
    OpenAI's `detail` (None: not given)."""

    source: Any
    detail: str | None = None


def chat_images(messages: Sequence[Mapping[str, Any]]) -> list[ChatImage]:
    """Every image part's image, in message and part order; raises ChatTemplateError for a part
    without one."""
    images = []
    for position, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, str) or not isinstance(content, Sequence):
            continue
        for index, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") not in IMAGE_PART_TYPES:
                continue
            where = f"messages[{position}].content[{index}]"
            if part["type"] == "image":
                if part.get("image") is None:
                    raise ChatTemplateError(f"{where} is an image part without its image")
                images.append(ChatImage(part["image"]))
                continue
            value = part.get("image_url")
            url, detail = (value.get("url"), value.get("detail")) if isinstance(value, Mapping) \
                else (value, None)
            if not isinstance(url, str) or not url:
                raise ChatTemplateError(f"{where}.image_url.url must be a string (a data: URL or a location)")
            images.append(ChatImage(url, detail))
    return images
