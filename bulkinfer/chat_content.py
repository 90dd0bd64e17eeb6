"""How chat message content reaches a chat template, shared by the engine (engine/chat.py) and the
API's dry runs (jobs/tokenizer_files.py), which must render a row the same way (torch-free).

Text content stays a string (text parts joined with "\\n", as vLLM does); an image part (OpenAI's
`image_url`, or `{"type": "image", ...}`) becomes `{"type": "image"}`, where the template writes its
image placeholder, and a message with one keeps its content as a list of parts, as does every message
for a template that only reads lists (SmolVLM's)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

IMAGE_PART_TYPES = ("image_url", "image")
TEXT_PARTS_SEPARATOR = "\n"
_LOOPS_OVER_CONTENT = re.compile(r"for\s+\w+\s+in\s+message(\[['\"]content['\"]\]|\.content)")


class ContentError(ValueError):
    """A content value or part a template cannot be given; the message says which."""


def template_reads_parts(template: str | None) -> bool:
    """Whether a chat template loops over `message['content']` without a case for text content
    (SmolVLM's): every message must then come as a list of parts."""
    if not template:
        return False
    return _LOOPS_OVER_CONTENT.search(template) is not None and "is string" not in template


def template_content(content: Any, where: str, as_parts: bool) -> str | list[dict[str, Any]]:
    """`content` as the template gets it (see the module docstring); raises ContentError."""
    if content is None or isinstance(content, str):
        text = content or ""
        return [{"type": "text", "text": text}] if as_parts else text
    if not isinstance(content, Sequence) or isinstance(content, bytes):
        raise ContentError(f"{where}.content must be text or a list of content parts, "
                           f"got {type(content).__name__}")
    parts: list[dict[str, Any]] = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in IMAGE_PART_TYPES:
            parts.append({"type": "image"})
        elif kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        else:
            raise ContentError(f"{where}.content[{index}] must be a text part "
                               f"({{\"type\": \"text\", \"text\": ...}}) or an image part (image_url); "
                               f"got type {kind!r}")
    if as_parts or any(part["type"] == "image" for part in parts):
        return parts
    return TEXT_PARTS_SEPARATOR.join(part["text"] for part in parts)
