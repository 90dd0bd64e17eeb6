"""A row's prompt as token ids, with the model's tokenizer: completion prompts encoded as the engine
encodes text, chat messages through the model's chat template (or ChatML), with the row's tools in
the model's format and its thinking noted (`ChatPlan`). Shared by the worker's rows
(worker/hosts/engine_rows.py), the model hosts that build one per model, and `bulkinfer tune`."""

from __future__ import annotations

import threading
from typing import Any

from bulkinfer.engine.chat import ChatTemplateError, prompt_token_ids, render_chat
from bulkinfer.engine.multimodal.processing import ImageProcessorFamily
from bulkinfer.engine.token_bytes import TokenBytes
from bulkinfer.jobs.formats.rows import Row, RowErrorCode
from bulkinfer.worker.hosts.row_images import (
    has_images,
    no_images_message,
)
from bulkinfer.worker.tools.answers import PLAIN, ChatPlan
from bulkinfer.worker.tools.formats import (
    ToolFormat,
    template_renders_tools,
    template_tool_format,
    tool_format_named,
)
from bulkinfer.worker.tools.prompting import messages_with_tools
from bulkinfer.worker.tools.reasoning import template_thinks, thinking_state


class RowRejected(ValueError):
    """The worker cannot run this row; becomes the row's error with `code`."""

    def __init__(self, code: RowErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


# How a row's prompt was rendered (`PromptRenderer.prompt_format`): the job manifest lists them.
PROMPT_CHAT_TEMPLATE, PROMPT_CHATML, PROMPT_RAW = "chat_template", "chatml", "raw"


class PromptRenderer:
    """Turns rows into prompt token ids with the model's tokenizer.

    Completion prompts are encoded exactly as `LLMEngine` encodes text (`tokenizer.encode`), so a
    row gives the same tokens as the offline `LLM`. Chat messages go through
    `bulkinfer.engine.chat.render_chat` (the tokenizer's chat template, or ChatML when it has none) and are
    encoded without adding special tokens again (the template places them). A lock guards the tokenizer: the
    Rust tokenizer is not safe to share between threads.
    """

    def __init__(self, tokenizer: Any, tool_format: str | None = None,
                 image_family: ImageProcessorFamily | None = None, model: str = "") -> None:
        """`tool_format`: the deployment's tool-call format for this model (`tool_call_formats`), for
        a template without one of its own or to override it. `image_family`: the model's image
        processor (None: a text-only model, which refuses rows with images)."""
        self._tokenizer = tokenizer
        self.image_family = image_family
        self.model = model
        self._lock = threading.Lock()
        self._token_bytes: TokenBytes | None = None  # built for the first row that scores its prompt
        template = getattr(tokenizer, "chat_template", None)
        template = template if isinstance(template, str) else None
        self.tool_format: ToolFormat | None = (tool_format_named(tool_format) if tool_format
                                               else template_tool_format(template))
        self._renders_tools = template_renders_tools(template)
        self.thinks = template_thinks(template)

    def token_text(self, token_id: int) -> tuple[str, list[int]]:
        """A token's text and exact bytes, as the engine's logprobs give them."""
        with self._lock:
            if self._token_bytes is None:
                self._token_bytes = TokenBytes(self._tokenizer)
            return self._token_bytes.get(token_id)

    @property
    def has_chat_template(self) -> bool:
        """Whether the model's tokenizer has a chat template of its own."""
        return bool(getattr(self._tokenizer, "chat_template", None))

    def chat_messages(self, row: Row) -> list[dict[str, Any]] | None:
        """The messages the row's prompt is rendered from (None: a raw prompt)."""
        return self._messages(row)

    def _messages(self, row: Row) -> list[dict[str, Any]] | None:
        """The chat messages the row's prompt is rendered from; None: its raw `prompt`. A plain row
        runs as chat when it must, or when the model has a template (as Ray Data LLM and vLLM's
        `LLM.chat` render rows for an instruct model)."""
        if row.messages is not None:
            return row.messages
        if row.as_chat is not None and (row.chat_required or self.has_chat_template):
            return row.as_chat
        return None

    def prompt_format(self, row: Row) -> str:
        """How the row's prompt is rendered: `chat_template` (the model's), `chatml` (the fallback for
        a model without one) or `raw` (a completion prompt, as it is)."""
        if self._messages(row) is None:
            return PROMPT_RAW
        return PROMPT_CHAT_TEMPLATE if self.has_chat_template else PROMPT_CHATML

    def token_ids(self, row: Row) -> list[int]:
        """Raises `RowRejected` when the row's messages cannot be rendered or its text tokenized."""
        return self.prepare(row)[0]

    def prepare(self, row: Row) -> tuple[list[int], ChatPlan]:
        """The row's prompt token ids, and how its output is held and read (tools, thinking);
        raises `RowRejected`."""
        with self._lock:
            try:
                messages = self._messages(row)
                if messages is None:
                    if row.tools is not None:
                        raise RowRejected(RowErrorCode.INVALID_ROW, "tools need a chat row (messages)")
                    return list(self._tokenizer.encode(row.prompt or "")), PLAIN
                if self.image_family is None and has_images(messages):
                    raise RowRejected(RowErrorCode.INVALID_IMAGE, no_images_message(self.model))
                text = self._render(row, messages)
                thinking = thinking_state(text, self.thinks)
                plan = ChatPlan(row.tools, self.tool_format, thinking, row.hide_reasoning,
                                row.thinking_budget)
                return prompt_token_ids(self._tokenizer, text), plan
            except ChatTemplateError as error:
                raise RowRejected(RowErrorCode.INVALID_ROW, str(error)) from None
            except RowRejected:
                raise
            except Exception as error:  # noqa: BLE001 - a tokenizer may raise anything on odd text
                raise RowRejected(RowErrorCode.TOKENIZE_ERROR, "the model's tokenizer failed on this row: "
                                  f"{type(error).__name__}: {str(error)[:200]}") from None

    def _render(self, row: Row, messages: list[dict[str, Any]]) -> str:
        if row.tools is None:
            return render_chat(self._tokenizer, messages, **row.template_kwargs)
        if self.tool_format is None:
            raise RowRejected(RowErrorCode.INVALID_ROW, NO_TOOL_FORMAT)
        tools = row.tools.openai_tools()
        if self._renders_tools:
            return render_chat(self._tokenizer, messages, tools=tools, **row.template_kwargs)
        return render_chat(self._tokenizer, messages_with_tools(messages, tools, self.tool_format),
                           **row.template_kwargs)

    def encode_text(self, text: str) -> list[int]:
        """Text as token ids, without special tokens added."""
        with self._lock:
            return list(self._tokenizer.encode(text, add_special_tokens=False))

    def decode(self, token_ids: list[int]) -> str:
        """Output tokens as text, special tokens kept (how thinking and calls are read back)."""
        with self._lock:
            return self._tokenizer.decode(token_ids, skip_special_tokens=False)


NO_TOOL_FORMAT = ("this model's chat template has no tool-call format, so the row's tools cannot be offered; "
                  "the deployment can give the model one (the tool_call_formats setting, e.g. "
                  '{"<model>": "hermes"}; formats: hermes, llama3_json, mistral)')
