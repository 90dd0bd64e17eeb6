"""From a job `Row` to what the engine takes: prompt token ids and `engine.SamplingParams`.

Knobs a job may set but the engine cannot honour yet become a per-row error naming the knob,
never silently dropped; a knob at its neutral value (a penalty of 0, no stop strings) asks for
nothing and is accepted.
"""

from __future__ import annotations

import threading
from typing import Any

from engine import SamplingParams
from jobs.formats.rows import Row, RowErrorCode
from jobs.sampling import SamplingParams as JobSampling

# Job sampling fields the engine maps one to one.
ENGINE_FIELDS = ("temperature", "top_p", "top_k", "seed", "max_tokens", "stop_token_ids", "ignore_eos")
# Fields the engine does not support yet, with the value that means "off".
NEUTRAL_VALUES: dict[str, Any] = {"min_p": 0.0, "min_tokens": 0, "presence_penalty": 0.0,
                                  "frequency_penalty": 0.0, "repetition_penalty": 1.0, "stop": []}


class RowRejected(ValueError):
    """The worker cannot run this row; becomes the row's error with `code`."""

    def __init__(self, code: RowErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def engine_sampling(sampling: JobSampling) -> SamplingParams:
    """The engine's params for a row's merged sampling; raises `RowRejected` for an unsupported knob."""
    settings = sampling.as_dict()
    for name, value in settings.items():
        if name in ENGINE_FIELDS:
            continue
        if name == "logprobs":
            raise RowRejected(RowErrorCode.INVALID_SAMPLING, "logprobs are not supported by the engine yet")
        if name == "stop" and value:
            raise RowRejected(RowErrorCode.INVALID_SAMPLING,
                              "stop strings are not supported by the engine yet; use stop_token_ids")
        if NEUTRAL_VALUES.get(name, object()) != value:
            raise RowRejected(RowErrorCode.INVALID_SAMPLING,
                              f"{name}={value!r} is not supported by the engine yet")
    params = SamplingParams(**{name: settings[name] for name in ENGINE_FIELDS if name in settings})
    try:
        params.validate()
    except ValueError as error:
        raise RowRejected(RowErrorCode.INVALID_SAMPLING, str(error)) from None
    return params


class PromptRenderer:
    """Turns rows into prompt token ids with the model's tokenizer.

    Completion prompts are encoded exactly as `LLMEngine` encodes text (`tokenizer.encode`), so a
    row gives the same tokens as the offline `LLM`. Chat messages go through the tokenizer's chat
    template and are encoded without adding special tokens again (the template places them). A
    lock guards the tokenizer: the Rust tokenizer is not safe to share between threads.
    """

    def __init__(self, tokenizer: Any) -> None:  # a transformers tokenizer
        self._tokenizer = tokenizer
        self._lock = threading.Lock()

    def token_ids(self, row: Row) -> list[int]:
        """Raises `RowRejected` when the row's messages cannot be rendered."""
        with self._lock:
            if row.messages is None:
                return list(self._tokenizer.encode(row.prompt or ""))
            text = self._render_chat(row.messages)
            return list(self._tokenizer.encode(text, add_special_tokens=False))

    def _render_chat(self, messages: list[dict[str, Any]]) -> str:
        if not getattr(self._tokenizer, "chat_template", None):
            raise RowRejected(RowErrorCode.INVALID_ROW, "the model has no chat template, so chat messages "
                              "cannot be rendered; map a prompt_column or a template instead")
        try:
            return self._tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as error:  # noqa: BLE001 - a template may raise anything (jinja, its own checks)
            raise RowRejected(RowErrorCode.INVALID_ROW,
                              f"the chat template rejected these messages: {error}") from None


def engine_error_code(message: str | None) -> RowErrorCode:
    """The row error code for an engine rejection (its messages are the engine's own)."""
    if message and message.startswith("prompt has ") and "tokens" in message:
        return RowErrorCode.PROMPT_TOO_LONG
    if message == "prompt is empty":
        return RowErrorCode.INVALID_ROW
    return RowErrorCode.ENGINE_ERROR
