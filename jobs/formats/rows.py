"""The normalized row every reader produces and every worker consumes, and per-row errors."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from pydantic import ValidationError

from bulkinfer.jobs.embedding import EmbedRequest
from bulkinfer.jobs.formats.image_parts import (
    ImagePartError,
    cell_image_parts,
    check_image_count,
    checked_content,
    text_part,
)
from bulkinfer.jobs.formats.json_text import UnreadableJson, loads_untrusted
from bulkinfer.jobs.image_limits import ImageLimits
from bulkinfer.jobs.lora_adapters import is_adapter_location
from bulkinfer.jobs.response_format import RESPONSE_FORMAT, AnyResponseFormat, engine_response_format
from bulkinfer.jobs.sampling import JobSampling
from bulkinfer.jobs.spec import JobSpec
from bulkinfer.jobs.template import MissingColumn
from bulkinfer.jobs.tool_calls import ToolRequest

# Between the shared instructions and a row's own text; identical for every row, so the
# instructions stay one cacheable prefix.
INSTRUCTIONS_SEPARATOR = "\n\n"
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


class RowErrorCode(StrEnum):
    INVALID_JSON = "invalid_json"
    INVALID_ROW = "invalid_row"
    MISSING_COLUMN = "missing_column"
    INVALID_SAMPLING = "invalid_sampling"
    INVALID_RESPONSE_FORMAT = "invalid_response_format"
    TOO_MANY_SCHEMAS = "too_many_schemas"  # past the deployment's max_schemas_per_job
    DUPLICATE_CUSTOM_ID = "duplicate_custom_id"
    UNSUPPORTED_URL = "unsupported_url"
    # A row's image is missing, corrupt, too large, of a form or format we cannot read, or the row has
    # too many (jobs/formats/image_parts.py when read, worker/images/ when fetched): that row's error.
    INVALID_IMAGE = "invalid_image"
    UNKNOWN_LORA = "unknown_lora"  # the row names a LoRA adapter the model does not have registered
    UNKNOWN_MODEL = "unknown_model"  # a request's model is not the job's, an alias of it or its adapter
    INVALID_LORA = "invalid_lora"  # its adapter cannot be fetched, or the engine refuses it (rank, shapes)
    # Set by the worker, not the readers: the engine refused or failed the row.
    PROMPT_TOO_LONG = "prompt_too_long"
    TOKENIZE_ERROR = "tokenize_error"  # the model's tokenizer raised on this row's text
    INVALID_OUTPUT_JSON = "invalid_output_json"
    ENGINE_ERROR = "engine_error"
    EXPIRED = "expired"  # the job's completion_window passed before the row finished
    # its run killed the worker process, alone (worker/shards/shard_crashes.py)
    WORKER_CRASHED = "worker_crashed"


@dataclass(frozen=True, slots=True)
class Row:
    """One request for the engine: exactly one of `prompt` (completion) or `messages` (chat), or,
    in an embed job, `embed` (its inputs; `prompt` is then the text of a single-text row).

    `index` orders rows in the input: the 0-based row number for Parquet, the byte offset of the
    line for JSONL (a shard can number its rows without reading the bytes before it).
    """

    index: int
    row_id: str
    prompt: str | None
    messages: list[dict[str, Any]] | None
    sampling: JobSampling
    response_format: dict[str, Any] | None
    passthrough: dict[str, Any] = field(default_factory=dict)
    line: int | None = None  # JSONL: the line number within the shard
    embed: EmbedRequest | None = None  # an embed job's row: what to embed
    echo: bool = False  # OpenAI completions' `echo`: the output text and logprobs start with the prompt
    # The LoRA adapter it runs on: a name as the row or job gave it (the worker checks it is
    # registered), or the job's own adapter location; None: the base model.
    lora: str | None = None
    # Whether a `lora` name the model does not have is the row's error; False for an OpenAI line's
    # `body.model`, which may name one of OpenAI's models (the base runs it, as before adapters).
    lora_required: bool = True
    # Whether `lora` is a request's model name (an Anthropic request's `params.model`): a name that is
    # no adapter is then an unknown model, and the row's error says so (`unknown_model`).
    lora_names_model: bool = False
    # A plain row (prompt_column or template) as chat: the job's instructions as the system message,
    # the row's text as the user turn. The worker renders it through the model's chat template when
    # `chat_required` or the model has a template (`apply_chat_template` null), else `prompt` runs raw.
    # None: the row runs as `prompt` or `messages` say (OpenAI lines, apply_chat_template false).
    as_chat: list[dict[str, Any]] | None = None
    chat_required: bool = False
    # Functions the model may call, and how (jobs/tool_calls.py); None: none offered.
    tools: ToolRequest | None = None
    # Keyword arguments for the chat template (enable_thinking, reasoning_effort).
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    # The model's thinking is left out of the answer (an Anthropic request that did not ask for it).
    hide_reasoning: bool = False
    thinking_budget: int | None = None  # the most tokens a thinking model's thinking may take

    @property
    def is_chat(self) -> bool:
        return self.messages is not None

    @property
    def is_embed(self) -> bool:
        return self.embed is not None


@dataclass(frozen=True, slots=True)
class RowError:
    """A row that cannot run; it is reported in the error part and never fails the job.

    `line` is the 1-based line number inside the shard for JSONL inputs (`index` is the line's
    byte offset in the file).
    """

    index: int
    row_id: str
    code: RowErrorCode
    message: str
    line: int | None = None
    passthrough: dict[str, Any] = field(default_factory=dict)


def unreadable_row(index: int, row_id: str, error: Exception, line: int | None = None,
                   passthrough: dict[str, Any] | None = None) -> RowError:
    """The error of a row whose values broke a step no check foresaw: that row fails, never the job."""
    return RowError(index, row_id, RowErrorCode.INVALID_ROW,
                    f"the row's values cannot be used ({type(error).__name__}: {str(error)[:200]})",
                    line, passthrough or {})


class RowProblem(ValueError):
    """Raised while building a row; becomes a `RowError` with this code."""

    def __init__(self, code: RowErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code

    @classmethod
    def of_image(cls, error: ImagePartError) -> RowProblem:
        return cls(RowErrorCode(error.code), str(error))


def _decode_json_cell(value: Any, where: str, code: RowErrorCode) -> Any:
    # Parquet users often store objects as JSON text; accept both forms.
    if isinstance(value, str):
        try:
            return loads_untrusted(value)
        except UnreadableJson as error:
            raise RowProblem(code, f"{where} holds text that is not JSON ({error})") from None
    return value


def parse_sampling_overrides(value: Any, where: str) -> dict[str, Any]:
    """Validated per-row sampling overrides from a column value (an object, or its JSON text)."""
    if value is None:
        return {}
    value = _decode_json_cell(value, where, RowErrorCode.INVALID_SAMPLING)
    if not isinstance(value, Mapping):
        raise RowProblem(RowErrorCode.INVALID_SAMPLING, f"{where} must be an object of sampling parameters")
    # Parquet structs carry every field, null where unset: null means "not overridden".
    overrides = {key: item for key, item in value.items() if item is not None}
    try:
        JobSampling.model_validate(overrides)
    except ValidationError as error:
        raise RowProblem(RowErrorCode.INVALID_SAMPLING, f"{where}: {first_error_message(error)}") from None
    return overrides


def parse_response_format(value: Any, where: str) -> AnyResponseFormat | None:
    if value is None:
        return None
    value = _decode_json_cell(value, where, RowErrorCode.INVALID_RESPONSE_FORMAT)
    try:
        return RESPONSE_FORMAT.validate_python(value)
    except ValidationError as error:
        message = f"{where}: {first_error_message(error)}"
        raise RowProblem(RowErrorCode.INVALID_RESPONSE_FORMAT, message) from None


def first_error_message(error: ValidationError) -> str:
    """`field.path: problem` for the first error: one line, for a row's error message."""
    item = error.errors()[0]
    where = ".".join(str(part) for part in item["loc"])
    text = item["msg"].removeprefix("Value error, ")
    return f"{where}: {text}" if where else text


def validate_messages(value: Any, where: str, limits: ImageLimits = ImageLimits()) -> list[dict[str, Any]]:
    """Chat messages with roles and content, their `image_url` parts checked (jobs/formats/image_parts.py)
    within `limits`; raises `RowProblem` naming the field."""
    value = _decode_json_cell(value, where, RowErrorCode.INVALID_ROW)
    if not isinstance(value, list) or not value:
        raise RowProblem(RowErrorCode.INVALID_ROW, f"{where} must be a non-empty list of chat messages")
    for position, message in enumerate(value):
        role = message.get("role") if isinstance(message, Mapping) else None
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise RowProblem(RowErrorCode.INVALID_ROW,
                             f"{where}[{position}] needs a role (one of {', '.join(sorted(CHAT_ROLES))})")
        if "content" not in message and not message.get("tool_calls"):  # a call alone needs no content
            raise RowProblem(RowErrorCode.INVALID_ROW, f"{where}[{position}] has no content")
    # Parquet structs carry every field; drop the nulls so messages look like the JSON a user wrote.
    messages = [{key: item for key, item in message.items() if item is not None} for message in value]
    try:
        for position, message in enumerate(messages):
            if "content" in message:
                message["content"] = checked_content(message["role"], message["content"],
                                                     f"{where}[{position}].content", limits)
        check_image_count(messages, limits)
    except ImagePartError as error:
        raise RowProblem.of_image(error) from None
    return messages


def requested_adapter(value: Any, where: str) -> str:
    """A row's adapter name as the worker resolves it; a location is only ever the job's own `lora`
    (the API checked the tenant may read it), never a row's."""
    if not isinstance(value, str):
        raise RowProblem(RowErrorCode.INVALID_ROW, f"{where} must be a LoRA adapter's name (text), got "
                         f"{type(value).__name__}")
    if is_adapter_location(value):
        raise RowProblem(RowErrorCode.UNKNOWN_LORA, f"{where} {value[:200]!r} is a location: a row names an "
                         "adapter registered on the model; give a location as the job's lora")
    return value


def with_instructions_prompt(instructions: str | None, text: str) -> str:
    return f"{instructions}{INSTRUCTIONS_SEPARATOR}{text}" if instructions else text


def with_instructions_messages(instructions: str | None,
                               messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The job's instructions as the first (system) message, so every row's prompt starts with the
    same tokens (one cached prefix). The rule:

    - the row starts with a system message: the instructions go first inside it, then
      `INSTRUCTIONS_SEPARATOR`, then the row's system text (text-part content: the instructions
      become its first text part, which the renderer joins with a newline);
    - otherwise a system message holding only the instructions is put before the row's messages
      (a leading `developer` message stays as it is, after it: templates treat that role differently).
    """
    if not instructions:
        return messages
    first = messages[0]
    if first.get("role") == "system":
        content = first.get("content")
        if isinstance(content, str):
            return [{**first, "content": f"{instructions}{INSTRUCTIONS_SEPARATOR}{content}"}, *messages[1:]]
        if isinstance(content, list):
            return [{**first, "content": [{"type": "text", "text": instructions}, *content]}, *messages[1:]]
    return [{"role": "system", "content": instructions}, *messages]


class RowBuilder:
    """Builds `Row`s from raw records (dicts of column → value) by a job's column mapping."""

    def __init__(self, spec: JobSpec, *, limits: ImageLimits | None = None) -> None:
        self.spec = spec
        self.limits = limits or ImageLimits()  # images: read_shard_rows passes the deployment's
        self.template = spec.prompt_template
        self.default_response_format = engine_response_format(spec.response_format)
        self.tools = spec.tool_request()
        self.template_kwargs = spec.template_kwargs()

    def build(self, index: int, record: Mapping[str, Any], line: int | None = None) -> Row | RowError:
        spec = self.spec
        passthrough = {column: record.get(column) for column in spec.passthrough_columns}
        row_id = str(index)
        try:
            row_id = self._row_id(index, record)
            prompt, messages, as_chat, has_images = self._request(record)
            overrides = {}
            if spec.sampling_column:
                overrides = parse_sampling_overrides(record.get(spec.sampling_column),
                                                     f"sampling_column {spec.sampling_column!r}")
            sampling = spec.sampling.merged(overrides)
            response_format = self.default_response_format
            if spec.response_format_column and record.get(spec.response_format_column) is not None:
                parsed = parse_response_format(record[spec.response_format_column],
                                               f"response_format_column {spec.response_format_column!r}")
                response_format = engine_response_format(parsed)
            lora = self._lora(record)
        except RowProblem as problem:
            return RowError(index, row_id, problem.code, str(problem), line, passthrough)
        except ValidationError as error:  # a row override that is valid alone but not merged
            code = RowErrorCode.INVALID_SAMPLING
            return RowError(index, row_id, code, first_error_message(error), line, passthrough)
        except (ValueError, TypeError, RecursionError, OverflowError) as error:  # values no check foresaw
            return unreadable_row(index, row_id, error, line, passthrough)
        if spec.is_embed:
            embed = EmbedRequest((prompt or "",), spec.dimensions, "float", spec.truncate, spec.pooling,
                                 spec.normalize, spec.max_length)
            return Row(index, row_id, prompt, None, sampling, None, passthrough, line, embed)
        return Row(index, row_id, prompt, messages, sampling, response_format, passthrough, line, lora=lora,
                   as_chat=as_chat,
                   chat_required=spec.apply_chat_template is True or self.tools is not None or has_images,
                   tools=self.tools, template_kwargs=self.template_kwargs,
                   thinking_budget=spec.thinking_token_budget)

    def _lora(self, record: Mapping[str, Any]) -> str | None:
        """The row's adapter: its `lora_column` name, else the job's `lora`, else None (the base)."""
        column = self.spec.lora_column
        value = record.get(column) if column else None
        if value is None or value == "":
            return self.spec.lora
        return requested_adapter(value, f"lora_column {column!r}")

    def _row_id(self, index: int, record: Mapping[str, Any]) -> str:
        column = self.spec.id_column
        return str(_required(record, column, "id_column")) if column else str(index)

    def _request(self, record: Mapping[str, Any]) -> tuple[str | None, list[dict[str, Any]] | None,
                                                           list[dict[str, Any]] | None, bool]:
        """(raw prompt, chat messages, the raw prompt's chat form, whether its image_column gave
        images: such a row runs as chat) of the row."""
        spec = self.spec
        if self.template is not None or spec.prompt_column:
            text = self._plain_text(record)
            images = self._images(record)
            return with_instructions_prompt(spec.instructions, text), None, self._as_chat(text, images), \
                bool(images)
        column = spec.messages_column
        if column is None:
            raise RowProblem(RowErrorCode.INVALID_ROW, "the job maps no column to a prompt")
        value = _required(record, column, "messages_column")
        messages = validate_messages(value, f"messages_column {column!r}", self.limits)
        return None, with_instructions_messages(spec.instructions, messages), None, False

    def _images(self, record: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The image parts of the row's `image_column` cell (none: a text-only row)."""
        column = self.spec.image_column
        if not column:
            return []
        try:
            return cell_image_parts(record.get(column), f"image_column {column!r}", self.limits)
        except ImagePartError as error:
            raise RowProblem.of_image(error) from None

    def _plain_text(self, record: Mapping[str, Any]) -> str:
        """The row's own text: its filled-in template, or its prompt_column."""
        if self.template is not None:
            try:
                return self.template.fill(record)
            except MissingColumn as missing:
                raise RowProblem(RowErrorCode.MISSING_COLUMN, str(missing)) from None
        column = self.spec.prompt_column or ""
        value = _required(record, column, "prompt_column")
        if not isinstance(value, str):
            raise RowProblem(RowErrorCode.INVALID_ROW, f"prompt_column {column!r} must be text, got "
                             f"{type(value).__name__}")
        return value

    def _as_chat(self, text: str, images: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
        """The plain row as chat (the user's turn under the instructions), unless the job wants raw
        prompts only; with images, the user's turn is the images, then the text, as parts."""
        if self.spec.apply_chat_template is False:
            return None
        content: str | list[dict[str, Any]] = [*images, text_part(text)] if images else text
        return with_instructions_messages(self.spec.instructions, [{"role": "user", "content": content}])


def _required(record: Mapping[str, Any], column: str, role: str) -> Any:
    if record.get(column) is None:
        state = "null" if column in record else "missing"
        raise RowProblem(RowErrorCode.MISSING_COLUMN, f"{role} {column!r} is {state} in this row")
    return record[column]
