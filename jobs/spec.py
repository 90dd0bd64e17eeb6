"""`JobSpec`: what a user submits. Validated here, stored as `jobs/<id>/job.json`, never changed."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from enum import StrEnum
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.json_schema import JsonDict

from bulkinfer.jobs.deadlines import WINDOW_SCHEMA_PATTERN, window_seconds
from bulkinfer.jobs.embedding import Pooling
from bulkinfer.jobs.formats.text_encoding import check_csv_encoding, csv_encoding_names
from bulkinfer.jobs.lora_adapters import is_adapter_location
from bulkinfer.jobs.object_store.factory import split_uri
from bulkinfer.jobs.response_format import ResponseFormat
from bulkinfer.jobs.sampling import JobSampling
from bulkinfer.jobs.template import PromptTemplate
from bulkinfer.jobs.tool_calls import ToolProblem, ToolRequest, openai_template_kwargs, openai_tool_request
from bulkinfer.jobs.webhooks import check_webhook_url

MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
# Output columns the writers own; a passthrough column of the same name would be ambiguous.
RESERVED_OUTPUT_COLUMNS = frozenset(
    {"id", "text", "json", "finish_reason", "usage", "prompt_tokens", "cached_tokens", "completion_tokens",
     "error", "error_code", "logprobs", "choices", "embedding", "embeddings", "prompt_logprobs"})


PRIORITY_NAMES = {"high": 8, "normal": 5, "low": 2}


def _csv_encoding_schema(schema: dict[str, Any]) -> None:
    """The encodings `check_csv_encoding` accepts by their canonical names (it takes aliases too)."""
    schema["anyOf"] = [{"enum": csv_encoding_names()}, {"type": "null"}]


def _priority_schema(schema: dict[str, Any]) -> None:
    """An integer 0-9 or one of the names (what `_priority_by_name` accepts)."""
    for key in ("type", "minimum", "maximum"):
        schema.pop(key, None)
    schema["anyOf"] = [{"type": "integer", "minimum": 0, "maximum": 9}, {"enum": list(PRIORITY_NAMES)}]


class JobTask(StrEnum):
    """What a job does with each row's prompt: generate text after it, or embed it as one vector."""

    GENERATE = "generate"
    EMBED = "embed"


class InputFormat(StrEnum):
    PARQUET = "parquet"
    JSONL = "jsonl"
    OPENAI_BATCH = "openai_batch"
    CSV = "csv"  # a header row, then one row a record; `"` quotes (jobs/formats/csv_records.py)
    TSV = "tsv"  # the same with tabs between the fields


DELIMITED_FORMATS = frozenset({InputFormat.CSV, InputFormat.TSV})  # text rows under a header row


_NAME_SUFFIXES = {(".parquet", ".pq"): InputFormat.PARQUET, (".jsonl", ".ndjson"): InputFormat.JSONL,
                  (".csv",): InputFormat.CSV, (".tsv", ".tab"): InputFormat.TSV}


def file_name(key: str) -> str:
    """The last part of a key or path: how messages name an input (never by the store's key for it)."""
    return key.rsplit("/", 1)[-1]


def format_from_name(key: str) -> InputFormat | None:
    """The format a file name implies; `.jsonl` may still turn out to be OpenAI batch JSONL."""
    name = file_name(key).lower()
    return next((found for suffixes, found in _NAME_SUFFIXES.items() if name.endswith(suffixes)), None)


# What the validators below enforce, stated in the published schema too (a schema-valid body should
# not be refused for a rule the schema does not say): split_uri's accepted forms, an http(s) URL.
# No NUL anywhere (split_uri refuses it, and lone surrogates, which JSON Schema text cannot hold).
_NAME = r"[^\x00]"
_PART = r"[^/\x00]"
URI_PATTERN = rf"^(s3://{_PART}+/{_NAME}*|file://(localhost)?/{_NAME}*|/{_NAME}*)$"
# Text, {{ / }} escapes and {field} placeholders, at least one placeholder (jobs/template.py's grammar:
# a name without `:` or `!`, which would start a format spec or a conversion).
_TEMPLATE_PIECE = r"([^{}]|\{\{|\}\}|\{[^{}:!]+\})*"
TEMPLATE_PATTERN = rf"^{_TEMPLATE_PIECE}\{{[^{{}}:!]+\}}{_TEMPLATE_PIECE}$"
OBJECT_URI_PATTERN = (  # one object, not a folder
    rf"^(s3://{_PART}+/{_NAME}*{_PART}|file://(localhost)?/{_NAME}*{_PART}|/{_NAME}*{_PART})$")
WEBHOOK_URL_PATTERN = r"^https?://[^/?#]+"


def _task_schema(schema: dict[str, Any]) -> None:
    """What `JobSpec._fits_the_task` enforces, in the published schema too: an embed job has no chat,
    JSON format or sampling; a generate job (the default) no `dimensions`, `truncate`, `max_length`,
    `pooling` or `normalize`."""
    nothing = {"type": "null"}
    schema["if"] = {"properties": {"task": {"const": JobTask.EMBED.value}}, "required": ["task"]}
    schema["then"] = {"properties": {
        "messages_column": nothing, "response_format": nothing, "response_format_column": nothing,
        "apply_chat_template": nothing, "image_column": nothing,
        "sampling_column": nothing, "lora": nothing, "lora_column": nothing,
        "sampling": {"type": "object", "additionalProperties": nothing}}}
    schema["else"] = {"properties": {"dimensions": nothing, "truncate": {"const": False},
                                     "max_length": nothing, "pooling": nothing, "normalize": nothing}}


# Each passthrough name is a column, and none is a name the outputs already use.
RESERVED_NAMES: list[JsonValue] = [*sorted(RESERVED_OUTPUT_COLUMNS)]
PASSTHROUGH_SCHEMA: JsonDict = {"uniqueItems": True,
                                "items": {"type": "string", "not": {"enum": RESERVED_NAMES}}}


class JobSpec(BaseModel):
    """A batch job. Unknown fields are rejected, so a typo never silently falls back to a default.

    Rows are mapped to prompts by exactly one of `prompt_column`, `messages_column` or `template`
    (none for OpenAI batch input, whose lines carry their own request bodies).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, json_schema_extra=_task_schema)

    input_uri: str = Field(description="s3://bucket/key, file:///abs/path or /abs/path",
                           json_schema_extra={"pattern": OBJECT_URI_PATTERN})
    input_format: InputFormat | None = Field(None, description="detected from the input when omitted "
                                             "(by its name for csv and tsv: .csv, .tsv, .tab)")
    csv_encoding: str | None = Field(None, min_length=1, max_length=64, description="CSV or TSV input: "
                                     "the text's encoding, e.g. cp1252 or latin-1 for files saved by "
                                     "Windows tools (default: utf-8, with or without a byte-order mark); "
                                     "outputs are always UTF-8", json_schema_extra=_csv_encoding_schema)
    model: str = Field(min_length=1)
    task: JobTask = Field(JobTask.GENERATE, description="generate: text after each prompt; embed: one "
                          "vector per prompt (an embedding model, or a decoder pooled; OpenAI lines with url "
                          "/v1/embeddings)")
    dimensions: int | None = Field(None, ge=1, description="embed: keep the first N values of each vector "
                                   "and renormalise (Matryoshka models); at most the model's size")
    truncate: bool = Field(False, description="embed: cut inputs longer than the model's maximum length "
                           "(default: such a row fails with prompt_too_long)")
    max_length: int | None = Field(None, ge=1, description="embed: at most this many tokens per input "
                                   "(special tokens included), within the model's own maximum (the "
                                   "checkpoint's sentence-transformers max_seq_length, else its positions); "
                                   "longer inputs fail their row, or are cut with truncate. Past the model's "
                                   "maximum the job fails, naming both")
    pooling: Pooling | None = Field(None, description="embed: mean, cls or last (token); default: the "
                                    "checkpoint's sentence-transformers files, else last for a decoder and "
                                    "mean for an encoder. A pooling other than the one those files fix "
                                    "fails the job")
    normalize: bool | None = Field(None, description="embed: scale each vector to unit length; default: "
                                   "the checkpoint's sentence-transformers files (a Normalize module), else "
                                   "true")

    id_column: str | None = Field(None, description="row ids; default: the row's index")
    prompt_column: str | None = None
    messages_column: str | None = Field(None, description="a list of {role, content} chat messages")
    template: str | None = Field(None, description="text with {column} placeholders ({{ and }}: literal "
                                                   "braces)", json_schema_extra={"pattern": TEMPLATE_PATTERN})
    image_column: str | None = Field(
        None, description="prompt_column / template rows: the column of each row's images (Parquet bytes, "
        "a data: URL, s3://bucket/key, a path as input_uri takes it or an http(s):// URL the deployment "
        "allows; or a list of those); a row with images runs as chat, its images before its text in the "
        "user turn; null or empty: a text-only row")
    instructions: str | None = Field(None, description="shared text placed first in every prompt")
    apply_chat_template: bool | None = Field(
        None, description="prompt_column / template rows: null (default) renders each through the model's "
        "chat template when it has one (instructions as the system message, the row as the user turn), "
        "as a raw completion prompt otherwise; true: always as chat (ChatML when the model has no "
        "template); false: a raw completion prompt (instructions, a blank line, the row). The manifest's "
        "prompt_formats says which ran")

    sampling: JobSampling = Field(default_factory=JobSampling)
    sampling_column: str | None = Field(None, description="per-row sampling overrides (an object)")
    response_format: ResponseFormat | None = None
    response_format_column: str | None = Field(None, description="per-row response_format (an object)")
    lora: str | None = Field(None, min_length=1, max_length=2048, description="the LoRA adapter every row "
                             "runs on: a name registered on the model (GET /models lists them), or the "
                             "adapter's folder as s3://bucket/prefix (a local path: in a local job store)")
    lora_column: str | None = Field(None, description="per-row LoRA adapter: a registered name; null or "
                                    "empty: the job's lora, else the base model. An unknown name is that "
                                    "row's unknown_lora error")
    tools: list[dict[str, Any]] | None = Field(
        None, description="functions every row may call, in OpenAI's shape ({type: function, function: "
        "{name, description, parameters}}); rows run as chat and calls come back in tool_calls")
    tool_choice: str | dict[str, Any] | None = Field(
        None, description="auto (default: text or calls), none, required (calls only), or {type: function, "
        "function: {name}} (a call of that function only)")
    parallel_tool_calls: bool | None = Field(None, description="more than one call per answer (default true)")
    enable_thinking: bool | None = Field(None, description="a thinking model's chat template switch "
                                         "(Qwen3's enable_thinking); default: the template's")
    reasoning_effort: str | None = Field(None, description="minimal, low, medium or high, for templates that "
                                         "read it")
    thinking_token_budget: int | None = Field(None, ge=1, description="the most tokens a thinking model's "
                                              "thinking may take before its answer (the grammar closes it)")

    output_uri: str | None = Field(None, description="where output parts go; default: the job's folder",
                                   json_schema_extra={"pattern": URI_PATTERN})
    output_format: InputFormat | None = Field(None, description="default: the input format")
    # The schema states the names the outputs already use, so a client sees the rule before it posts.
    passthrough_columns: list[str] = Field(
        default_factory=list, description="input columns copied to each output row; not an output "
        "column's own name", json_schema_extra=PASSTHROUGH_SCHEMA)

    shard_size: int = Field(1000, ge=1, le=1_000_000, description="rows per shard (approximate for JSONL)")
    deduplicate: bool = Field(True, description="rows of a shard whose rendered prompt and sampling are "
                              "identical and deterministic (greedy or seeded) run once and each gets the "
                              "output; rows sampled at random without a seed are never merged")
    priority: int = Field(5, ge=0, le=9, description="0-9, higher sooner, or high (8), normal (5), low (2): "
                          "a free worker takes the highest priority's shards first, and within a priority "
                          "shares out fairly between tenants, then between one tenant's jobs",
                          json_schema_extra=_priority_schema)
    completion_window: str | int | None = Field(
        None, description="how long the job may take, from its submit: '24h', '90m', '2d' or seconds; "
        "rows not done by then end as `expired` row errors and the job ends `expired`",
        json_schema_extra={"anyOf": [{"type": "string", "pattern": WINDOW_SCHEMA_PATTERN},
                                     {"type": "integer", "minimum": 1}, {"type": "null"}]})
    metadata: dict[str, str] = Field(default_factory=dict, json_schema_extra={
        "maxProperties": MAX_METADATA_PAIRS,
        "propertyNames": {"minLength": 1, "maxLength": MAX_METADATA_KEY_CHARS},
        "additionalProperties": {"type": "string", "maxLength": MAX_METADATA_VALUE_CHARS}})
    idempotency_key: str | None = Field(None, min_length=1, max_length=256)
    webhook_url: str | None = Field(None, description="POSTed the final status when the job ends (signed)",
                                    json_schema_extra={"pattern": WEBHOOK_URL_PATTERN, "maxLength": 2048})
    dry_run: bool = Field(False, description="validate and estimate only (rows, tokens, run time): "
                          "nothing is created or queued")
    tenant: str | None = Field(None, description="whose job it is: set by the API from the caller's key "
                                                 "(a value sent in a submit is replaced)")
    # Set by POST /jobs/{id}/retry (SERVER_SET_FIELDS: a user's spec that sets them is refused).
    parent_job_id: str | None = Field(None, description="the job whose failed rows this one runs again",
                                      json_schema_extra={"readOnly": True})
    retry_error_codes: list[str] | None = Field(None, description="with parent_job_id: only the parent's "
                                                "rows that failed with one of these codes (not_run: rows "
                                                "that never ran); None: every failed row",
                                                json_schema_extra={"readOnly": True})

    @field_validator("input_uri", "output_uri")
    @classmethod
    def _uri_is_openable(cls, value: str | None) -> str | None:
        if value is not None:
            split_uri(value)  # raises ValueError saying what is wrong
        return value

    @field_validator("input_uri")
    @classmethod
    def _input_names_an_object(cls, value: str) -> str:
        key = split_uri(value)[2]
        if not key or key.endswith("/"):
            raise ValueError(f"input_uri must name one object, not a folder: {value!r}")
        return value

    @field_validator("csv_encoding")
    @classmethod
    def _csv_encoding_is_readable(cls, value: str | None) -> str | None:
        return None if value is None else check_csv_encoding(value)  # ValueError says why not

    @field_validator("priority", mode="before")
    @classmethod
    def _priority_by_name(cls, value: object) -> object:
        return PRIORITY_NAMES.get(value, value) if isinstance(value, str) else value

    @field_validator("completion_window")
    @classmethod
    def _window_parses(cls, value: str | int | None) -> str | int | None:
        if value is not None:
            window_seconds(value)  # raises ValueError saying what is wrong
        return value

    @property
    def completion_window_s(self) -> float | None:
        return None if self.completion_window is None else window_seconds(self.completion_window)

    @field_validator("webhook_url")
    @classmethod
    def _webhook_is_http(cls, value: str | None) -> str | None:
        return check_webhook_url(value) if value is not None else None

    @field_validator("lora")
    @classmethod
    def _lora_location_is_openable(cls, value: str | None) -> str | None:
        if value is not None and is_adapter_location(value):
            split_uri(value)  # raises ValueError saying what is wrong
        return value

    @field_validator("template")
    @classmethod
    def _template_parses(cls, value: str | None) -> str | None:
        if value is not None:
            PromptTemplate.parse(value, fixed_text=True)  # placeholders: checked with image_column
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata_within_limits(cls, value: dict[str, str]) -> dict[str, str]:
        return metadata_within_limits(value)

    @field_validator("passthrough_columns")
    @classmethod
    def _passthrough_names_are_free(cls, value: list[str]) -> list[str]:
        reserved = sorted(set(value) & RESERVED_OUTPUT_COLUMNS)
        if reserved:
            raise ValueError(f"{', '.join(reserved)} would collide with output columns of the same name")
        if len(set(value)) != len(value):
            raise ValueError("columns are listed more than once")
        return value

    @model_validator(mode="after")
    def _mapping_fits_the_format(self) -> JobSpec:
        mapping = [name for name in ("prompt_column", "messages_column", "template") if getattr(self, name)]
        if self.input_format == InputFormat.OPENAI_BATCH:
            if mapping:
                raise ValueError(f"{mapping[0]}: OpenAI batch lines carry their own request body; "
                                 "omit prompt_column, messages_column and template")
            if self.id_column:
                raise ValueError("id_column: OpenAI batch rows are identified by custom_id; omit id_column")
            for name in ("lora", "lora_column"):
                if getattr(self, name):
                    raise ValueError(f"{name}: OpenAI batch lines choose their adapter by body.model "
                                     "(a registered adapter's name); omit it")
        elif len(mapping) > 1:
            raise ValueError(f"give exactly one of prompt_column, messages_column or template, not "
                             f"{' and '.join(mapping)}")
        elif not mapping and self.input_format is not None:
            raise ValueError(f"{self.input_format.value} input needs exactly one of prompt_column, "
                             "messages_column or template")
        if self.csv_encoding and self.input_format is not None and self.input_format not in DELIMITED_FORMATS:
            raise ValueError(f"csv_encoding: only CSV or TSV input has a text encoding to choose, not "
                             f"{self.input_format.value}")
        self._fits_the_task()
        self._images_fit_the_rows()
        if self.apply_chat_template is not None and not (self.prompt_column or self.template):
            openai = self.input_format == InputFormat.OPENAI_BATCH
            source = "OpenAI batch lines say it by their url" if openai else "messages_column rows are chat"
            raise ValueError(f"apply_chat_template: only prompt_column or template rows choose how they are "
                             f"rendered ({source}); omit it")
        if (self.lora or self.lora_column) and "lora" in self.passthrough_columns:
            raise ValueError("passthrough_columns: 'lora' would collide with the output column naming each "
                             "row's LoRA adapter")
        if self.effective_output_format == InputFormat.OPENAI_BATCH and self.passthrough_columns:
            raise ValueError("passthrough_columns: OpenAI batch output lines have no room for extra columns")
        return self

    def _images_fit_the_rows(self) -> None:
        """`image_column` adds images to prompt_column or template rows, which then run as chat; a
        template may then be one fixed text (every photo, the same question)."""
        if self.image_column is None:
            if self.template is not None:
                try:
                    PromptTemplate.parse(self.template)
                except ValueError as error:
                    raise ValueError(f"template: {error}") from None
            return
        if not (self.prompt_column or self.template):
            raise ValueError("image_column: only prompt_column or template rows take their images from a "
                             "column; chat messages (messages_column, OpenAI batch lines) carry image_url "
                             "parts in their content")
        if self.image_column == self.prompt_column:
            raise ValueError("image_column: it is the prompt_column; give the images a column of their own")
        if self.apply_chat_template is False:
            raise ValueError("image_column: rows with images run as chat; apply_chat_template false runs "
                             "raw prompts")

    def _fits_the_task(self) -> None:
        """An embed job has no sampling and no chat; a generate job has no vector to shorten, pool or
        normalize."""
        if self.task == JobTask.GENERATE:
            if self.dimensions is not None:
                raise ValueError("dimensions: only an embed job (task: embed) has vectors to shorten")
            if self.truncate:
                raise ValueError("truncate: only an embed job (task: embed) truncates its inputs")
            if self.max_length is not None:
                raise ValueError("max_length: only an embed job (task: embed) limits its inputs' tokens")
            if self.pooling is not None:
                raise ValueError("pooling: only an embed job (task: embed) pools token vectors")
            if self.normalize is not None:
                raise ValueError("normalize: only an embed job (task: embed) has vectors to normalize")
            return
        refused = {
            "messages_column": "an embed job embeds text: use prompt_column or template",
            "apply_chat_template": "an embed job embeds each row's text as it is",
            "image_column": "an embed job embeds text",
            "response_format": "an embed job writes vectors, not JSON text",
            "response_format_column": "an embed job writes vectors, not JSON text",
            "sampling_column": "an embed job samples nothing",
            "lora": "an embed job runs no LoRA adapter",
            "lora_column": "an embed job runs no LoRA adapter",
            "tools": "an embed job calls no functions",
            "tool_choice": "an embed job calls no functions",
            "enable_thinking": "an embed job does not think",
            "reasoning_effort": "an embed job does not think",
            "thinking_token_budget": "an embed job does not think",
        }
        for name, why in refused.items():
            if getattr(self, name) is not None:
                raise ValueError(f"{name}: {why}; omit it")
        if self.sampling.as_dict():
            raise ValueError(f"sampling: an embed job samples nothing; omit sampling "
                             f"({', '.join(sorted(self.sampling.as_dict()))} given)")

    @model_validator(mode="after")
    def _tools_run(self) -> JobSpec:
        self.tool_request()  # raises naming the field
        self.template_kwargs()
        if self.tools and self.apply_chat_template is False:
            raise ValueError("tools: calls need the chat template; apply_chat_template false runs "
                             "raw prompts")
        return self

    def tool_request(self) -> ToolRequest | None:
        """The job's `tools` as every row offers them (None: none); raises ValueError naming the field."""
        body = {"tools": self.tools, "tool_choice": self.tool_choice,
                "parallel_tool_calls": self.parallel_tool_calls}
        try:
            return openai_tool_request(body, where="spec")
        except ToolProblem as problem:
            raise ValueError(str(problem).removeprefix("spec.")) from None

    def template_kwargs(self) -> dict[str, Any]:
        """`enable_thinking` and `reasoning_effort` for every row's chat template."""
        body: dict[str, Any] = {"reasoning_effort": self.reasoning_effort}
        if self.enable_thinking is not None:
            body["chat_template_kwargs"] = {"enable_thinking": self.enable_thinking}
        try:
            return openai_template_kwargs(body, where="spec")
        except ToolProblem as problem:
            raise ValueError(str(problem).removeprefix("spec.")) from None

    @property
    def is_embed(self) -> bool:
        return self.task == JobTask.EMBED

    @property
    def effective_output_format(self) -> InputFormat | None:
        return self.output_format or self.input_format

    @property
    def prompt_template(self) -> PromptTemplate | None:
        return PromptTemplate.parse(self.template, fixed_text=True) if self.template else None

    def input_columns(self) -> list[str]:
        """Every column a row is read from (for reading only those columns of a Parquet file)."""
        columns = [self.id_column, self.prompt_column, self.messages_column, self.image_column,
                   self.sampling_column, self.response_format_column, self.lora_column]
        template = self.prompt_template
        named = [c for c in columns if c] + (template.columns if template else []) + self.passthrough_columns
        return list(dict.fromkeys(named))

    def required_columns(self) -> list[str]:
        """Columns the input must have: a Parquet file without one cannot run at all (every row needs
        them, but `image_column`, where a null cell is a text-only row: its absence is a misspelling)."""
        template = self.prompt_template
        named = [self.id_column, self.prompt_column, self.messages_column, self.image_column]
        return list(dict.fromkeys([c for c in named if c] + (template.columns if template else [])))

    def with_formats(self, input_format: InputFormat | str) -> JobSpec:
        """This spec with the detected input format, and the output format defaulted (revalidated)."""
        data = self.model_dump(mode="json", by_alias=True, exclude_none=True)
        data["input_format"] = InputFormat(input_format).value
        data.setdefault("output_format", data["input_format"])
        return JobSpec.model_validate(data)

    def canonical_json(self) -> str:
        """What job.json holds: defaults filled in, fields in the model's order, and the user's own
        objects (a JSON schema above all) in the user's order: a schema's property order is the
        order the model writes the properties in, which changes what it writes."""
        data = self.model_dump(mode="json", by_alias=True)
        return json.dumps(data, separators=(",", ":"), ensure_ascii=False)

    def spec_hash(self) -> str:
        """sha256 of the spec without its idempotency key: equal work, equal hash.

        Fields at their default are left out, so a field added later (with a default) does not
        change the hash of a spec stored before. Compare specs in the same state: both as
        submitted, or both after `with_formats`.
        """
        data = self.model_dump(mode="json", by_alias=True, exclude_defaults=True, exclude={"idempotency_key"})
        encoded = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return hashlib.sha256(encoded.encode()).hexdigest()


# Fields of a spec only the server sets (POST /jobs/{id}/retry makes a job of another job's rows):
# a spec a user sends, in a submit (dry runs and uploads too) or in a schedule's job template, may
# not set them; `tenant` is not among them, since a value sent is replaced by the caller's.
SERVER_SET_FIELDS = {
    "parent_job_id": "set by POST /jobs/{id}/retry, which makes a job of another job's failed rows",
    "retry_error_codes": "set by POST /jobs/{id}/retry (its error_codes)",
}


class ServerSetField(ValueError):
    """A user's spec sets a field only the server sets."""


def server_set_problems(data: Mapping[str, Any]) -> list[str]:
    """`field: why` for each server-set field a user's spec gives a value (null is as good as absent)."""
    return [f"{name}: {why}; a spec you send cannot set it" for name, why in SERVER_SET_FIELDS.items()
            if data.get(name) is not None]


def check_user_spec(data: Mapping[str, Any]) -> None:
    """The one check of every spec a user sends: `ServerSetField` naming the fields it may not set."""
    problems = server_set_problems(data)
    if problems:
        raise ServerSetField("; ".join(problems))


def validation_messages(error: ValidationError) -> list[str]:
    """`field.path: problem` lines for an API error body or a CLI message."""
    messages = []
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"])
        text = item["msg"].removeprefix("Value error, ")
        messages.append(f"{where}: {text}" if where else text)
    return messages


def metadata_within_limits(value: dict[str, str]) -> dict[str, str]:
    """`value` when it keeps OpenAI's metadata limits (16 pairs, 64-character keys, 512-character
    values); ValueError naming the first it breaks."""
    if len(value) > MAX_METADATA_PAIRS:
        raise ValueError(f"at most {MAX_METADATA_PAIRS} key/value pairs, got {len(value)}")
    for key, item in value.items():
        if not key or len(key) > MAX_METADATA_KEY_CHARS:
            raise ValueError(f"key {key[:80]!r} must be 1 to {MAX_METADATA_KEY_CHARS} characters")
        if len(item) > MAX_METADATA_VALUE_CHARS:
            raise ValueError(f"value of {key!r} is longer than {MAX_METADATA_VALUE_CHARS} characters")
    return value
