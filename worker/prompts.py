"""From a job `Row` to what the engine takes: prompt token ids and `engine.SamplingParams`.

Every job sampling knob has an engine field of the same name (vLLM's names), so the mapping is one
to one; the engine's own validation decides what is valid, and its message (naming the knob)
becomes the row's INVALID_SAMPLING error. A row's `response_format` becomes the engine's
`json_schema`: the schema of a `json_schema` format, or True (any JSON object) for `json_object`.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from engine import ErrorKind, SamplingParams, SamplingParamsError
from engine.chat import ChatTemplateError, chat_token_ids
from jobs.formats.rows import Row, RowErrorCode
from jobs.response_format import engine_response_format
from jobs.sampling import SamplingParams as JobSampling
from jobs.spec import JobSpec

ENGINE_FIELDS = frozenset(field.name for field in dataclasses.fields(SamplingParams))
# The row error code of each way the engine refuses or fails a request (engine/errors.py): the one
# table between the engine's codes and the jobs' (its messages are for people, never parsed).
ROW_CODES = {
    ErrorKind.PROMPT_TOO_LONG: RowErrorCode.PROMPT_TOO_LONG,
    ErrorKind.EMPTY_PROMPT: RowErrorCode.INVALID_ROW,
    ErrorKind.INVALID_PROMPT: RowErrorCode.INVALID_ROW,
    ErrorKind.INVALID_SAMPLING: RowErrorCode.INVALID_SAMPLING,
    ErrorKind.STRUCTURED_OUTPUT: RowErrorCode.INVALID_RESPONSE_FORMAT,  # e.g. a schema that does not compile
    ErrorKind.NON_FINITE_LOGITS: RowErrorCode.ENGINE_ERROR,
    ErrorKind.ENGINE_FAILURE: RowErrorCode.ENGINE_ERROR,
}


class RowRejected(ValueError):
    """The worker cannot run this row; becomes the row's error with `code`."""

    def __init__(self, code: RowErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def engine_sampling(sampling: JobSampling, response_format: dict[str, Any] | None = None) -> SamplingParams:
    """The engine's params for a row's merged sampling and response_format; raises `RowRejected`."""
    settings = sampling.as_dict()
    unknown = sorted(set(settings) - ENGINE_FIELDS)
    if unknown:  # a job knob this engine build lacks: refused by name, never dropped
        raise RowRejected(RowErrorCode.INVALID_SAMPLING, f"{unknown[0]} is not supported by this engine")
    params = SamplingParams(**settings, json_schema=engine_json_schema(response_format))
    try:  # early, so the row is refused before it is rendered; the engine's own check is the same
        params.validate()
    except SamplingParamsError as error:
        raise RowRejected(engine_error_code(error.kind), str(error)) from None
    return params


def engine_json_schema(response_format: dict[str, Any] | None) -> dict[str, Any] | bool | None:
    """A row's response_format (the OpenAI wire shape `jobs.response_format` gives) as the engine's
    `json_schema`: the schema dict, True for any JSON object, None for plain text."""
    if response_format is None or response_format.get("type") == "text":
        return None
    if response_format.get("type") == "json_object":
        return True
    if response_format.get("type") == "json_schema":
        return response_format["json_schema"]["schema"]
    raise RowRejected(RowErrorCode.INVALID_RESPONSE_FORMAT,
                      f"response_format type {response_format.get('type')!r} is not supported")


def job_response_format_problem(spec: JobSpec) -> str | None:
    """Why the job's own response_format can never compile, as `response_format: <reason>` (checked
    once, without a model, at plan and before `bulkinfer run`), or None. Rows' own formats are
    still checked by the engine, row by row."""
    try:
        schema = engine_json_schema(engine_response_format(spec.response_format))
    except RowRejected as rejected:
        return f"response_format: {rejected}"
    if schema is None:
        return None
    from engine.structured_output import StructuredSpec, check_spec  # xgrammar: only when used

    try:
        check_spec(StructuredSpec.json_schema(schema))
    except ValueError as error:  # GrammarError, or a schema that is not a dict
        return f"response_format: {error}"
    return None


class PromptRenderer:
    """Turns rows into prompt token ids with the model's tokenizer.

    Completion prompts are encoded exactly as `LLMEngine` encodes text (`tokenizer.encode`), so a
    row gives the same tokens as the offline `LLM`. Chat messages go through `engine.chat.render_chat`
    (the tokenizer's chat template, or ChatML when it has none) and are encoded without adding
    special tokens again (the template places them). A lock guards the tokenizer: the Rust
    tokenizer is not safe to share between threads.
    """

    def __init__(self, tokenizer: Any) -> None:  # a transformers tokenizer
        self._tokenizer = tokenizer
        self._lock = threading.Lock()

    def token_ids(self, row: Row) -> list[int]:
        """Raises `RowRejected` when the row's messages cannot be rendered."""
        with self._lock:
            if row.messages is None:
                return list(self._tokenizer.encode(row.prompt or ""))
            try:
                return chat_token_ids(self._tokenizer, row.messages)
            except ChatTemplateError as error:
                raise RowRejected(RowErrorCode.INVALID_ROW, str(error)) from None


def engine_error_code(kind: ErrorKind | str | None) -> RowErrorCode:
    """The row error code for an engine rejection or failure, from its `error_kind`."""
    try:
        return ROW_CODES[ErrorKind(kind)] if kind is not None else RowErrorCode.ENGINE_ERROR
    except (ValueError, KeyError):  # a kind this worker does not know yet
        return RowErrorCode.ENGINE_ERROR
