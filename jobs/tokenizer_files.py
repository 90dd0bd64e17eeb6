"""A model's tokenizer where the API can read it, without torch or transformers: for dry runs.

A worker that loads a model publishes its tokenizer to the job store once
(`<prefix>/models/<name>/tokenizer.json`: the fast tokenizer's own JSON, its chat template and
special tokens). The API rebuilds it with the light `tokenizers` package and renders chat messages
with jinja2 the way transformers' `apply_chat_template` does (sandboxed, trim_blocks and lstrip_blocks,
`tojson`, `raise_exception`, the special tokens as variables), so it counts the tokens a worker would
compute: completion prompts encoded with the tokenizer's special tokens, chat prompts rendered then
encoded without them (the template places them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import lru_cache
from typing import Any

from bulkinfer.chat_content import (
    TEXT_PARTS_SEPARATOR,
    ContentError,
    template_content,
    template_reads_parts,
)
from bulkinfer.jobs.formats.image_parts import iter_image_parts
from bulkinfer.jobs.object_store.base import ObjectNotFound, ObjectStore

__all__ = ["TEXT_PARTS_SEPARATOR"]  # re-exported: the Anthropic reader joins text blocks as templates do

# The engine's ChatML fallback for a tokenizer without a template (engine/chat.py's
# DEFAULT_CHAT_TEMPLATE, which tests/jobs/test_tokenizer_files.py holds equal to this).
DEFAULT_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def tokenizer_key(prefix: str, model: str) -> str:
    return f"{prefix.strip('/')}/models/{model}/tokenizer.json".lstrip("/")


def publish_tokenizer(store: ObjectStore, prefix: str, model: str, tokenizer: Any, worker: str,
                      image_spans: ImageSpans | None = None) -> bool:
    """Write a transformers fast tokenizer's files for `model` (again only when they changed);
    False for a slow tokenizer, which has no JSON to publish. `image_spans`: how many prompt tokens
    an image takes, for a model that takes images."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    template = getattr(tokenizer, "chat_template", None)
    document = {"tokenizer_json": backend.to_str(), "chat_template": template if isinstance(template, str)
                else None, "special_tokens": {name: str(value) for name, value in
                                              tokenizer.special_tokens_map.items() if isinstance(value, str)},
                "image_spans": None if image_spans is None else image_spans.as_dict()}
    body = json.dumps(document, ensure_ascii=False, sort_keys=True)
    key = tokenizer_key(prefix, model)
    try:
        if json.loads(store.get_bytes(key)).get("tokenizer") == json.loads(body):
            return True
    except (ObjectNotFound, ValueError):
        pass
    wrapped = {"tokenizer": document, "published_by": worker, "published_at": datetime.now(UTC).isoformat()}
    store.put_bytes(key, json.dumps(wrapped, ensure_ascii=False).encode())
    return True


class ChatRenderError(ValueError):
    """The messages are invalid or the chat template failed on them."""


@dataclass(frozen=True)
class ImageSpans:
    """A model's image prompt spans: the placeholder its chat template writes for an image, and the
    most tokens an image takes in place of it with `detail: "low"` and otherwise (the size of a
    picture is not known before a worker reads it: a dry run counts the most)."""

    placeholder: str
    low: int
    most: int

    def as_dict(self) -> dict[str, Any]:
        return {"placeholder": self.placeholder, "low": self.low, "most": self.most}

    def tokens(self, detail: str | None) -> int:
        return self.low if detail == "low" else self.most


@dataclass(frozen=True)
class PublishedTokenizer:
    """Counts prompt tokens as a worker would (see the module docstring)."""

    backend: Any  # tokenizers.Tokenizer
    chat_template: str
    special_tokens: dict[str, str]
    published_by: str
    published_at: str
    # Whether the model has a chat template of its own (`chat_template` is then it, else ChatML):
    # plain rows render through it by default, as the worker renders them.
    has_own_template: bool = False

    def completion_tokens(self, prompt: str) -> list[int]:
        return list(self.backend.encode(prompt, add_special_tokens=True).ids)

    # How many tokens an image takes (None: the model takes no images, or its worker predates them).
    image_spans: ImageSpans | None = None

    def chat_tokens(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """The prompt's tokens, each image's placeholder repeated for the tokens the image takes."""
        text = render_chat(self.chat_template, messages, self.special_tokens, tools, template_kwargs)
        ids = list(self.backend.encode(text, add_special_tokens=False).ids)
        details = [detail for _, _, detail in iter_image_parts(messages)]
        spans = self.image_spans
        if not details or spans is None:
            return ids
        placeholder = self.backend.token_to_id(spans.placeholder)
        expanded: list[int] = []
        images = iter(details)
        for token in ids:
            count = spans.tokens(next(images, None)) if token == placeholder else 1
            expanded.extend([token] * count)
        return expanded


def load_tokenizer(store: ObjectStore, prefix: str, model: str) -> PublishedTokenizer | None:
    """The tokenizer a worker published for `model`, or None when none has yet."""
    try:
        raw = store.get_bytes(tokenizer_key(prefix, model))
    except ObjectNotFound:
        return None
    return _parse(raw)


@lru_cache(maxsize=16)
def _parse(raw: bytes) -> PublishedTokenizer:
    from tokenizers import Tokenizer

    wrapped = json.loads(raw)
    document = wrapped["tokenizer"]
    spans = document.get("image_spans")
    return PublishedTokenizer(Tokenizer.from_str(document["tokenizer_json"]),
                              document.get("chat_template") or DEFAULT_CHAT_TEMPLATE,
                              dict(document.get("special_tokens") or {}), str(wrapped.get("published_by")),
                              str(wrapped.get("published_at")), bool(document.get("chat_template")),
                              ImageSpans(**spans) if isinstance(spans, dict) else None)


def render_chat(template: str, messages: list[dict[str, Any]], special_tokens: dict[str, str],
                tools: list[dict[str, Any]] | None = None,
                template_kwargs: dict[str, Any] | None = None) -> str:
    """The prompt text for `messages`, ready for the reply (as transformers renders it), with the
    row's `tools` and template switches (`enable_thinking`, `reasoning_effort`)."""
    as_parts = template_reads_parts(template)
    try:
        normalized = [{**message, "content": template_content(message.get("content"), f"messages[{i}]",
                                                              as_parts)}
                      for i, message in enumerate(messages)]
    except ContentError as error:
        raise ChatRenderError(str(error)) from None
    try:
        return _compiled(template).render(messages=normalized, add_generation_prompt=True, tools=tools,
                                          documents=None, **special_tokens, **(template_kwargs or {}))
    except Exception as error:  # noqa: BLE001 - a template may raise anything (jinja, its raise_exception)
        raise ChatRenderError(f"the chat template failed on these messages: {error}") from None


@lru_cache(maxsize=16)
def _compiled(template: str) -> Any:
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ChatRenderError(message)

    def tojson(value: Any, indent: int | None = None) -> str:
        return json.dumps(value, ensure_ascii=False, indent=indent)

    def strftime_now(pattern: str) -> str:
        return datetime.now().strftime(pattern)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = strftime_now
    return environment.from_string(template)
