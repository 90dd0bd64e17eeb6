"""OpenAI Batch API input lines: `{"custom_id", "method", "url", "body"}`, accepted unchanged.

The job's `model` runs every line; a line's `body.model` naming a LoRA adapter registered on it
runs the line on that adapter (as vLLM's server does); any other name is ignored (files written for
OpenAI name OpenAI models; the worker tells the two apart: worker/hosts/lora_requests.py). A
`/v1/messages` line carries an Anthropic Messages request instead
(`jobs/formats/anthropic_messages.py`: that is how an Anthropic batch runs, and its `model` must be
the job's or one of its adapters). A `custom_id` that appears more than once fails every line after
its first, as that row's `duplicate_custom_id` error: within a shard as it is read, across shards
from the plan (`find_duplicate_custom_ids` scans the whole file once at planning, and each shard's
plan lists its lines that repeat an earlier one).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

from pydantic import ValidationError

from bulkinfer.jobs.formats.anthropic_messages import MESSAGES_URL, AnthropicMessagesRowBuilder
from bulkinfer.jobs.formats.jsonl import decode_object_line
from bulkinfer.jobs.formats.lines import Line, iter_lines_in_range
from bulkinfer.jobs.formats.openai_embeddings import EMBEDDINGS_URL, embedding_row
from bulkinfer.jobs.formats.rows import (
    Row,
    RowError,
    RowErrorCode,
    RowProblem,
    first_error_message,
    parse_response_format,
    parse_sampling_overrides,
    requested_adapter,
    unreadable_row,
    validate_messages,
    with_instructions_messages,
    with_instructions_prompt,
)
from bulkinfer.jobs.image_limits import ImageLimits
from bulkinfer.jobs.object_store.base import ObjectStore
from bulkinfer.jobs.output_tokens import COMPLETIONS_DEFAULT_MAX_TOKENS
from bulkinfer.jobs.response_format import engine_response_format
from bulkinfer.jobs.spec import JobSpec
from bulkinfer.jobs.tool_calls import (
    ToolProblem,
    openai_template_kwargs,
    openai_tool_request,
    thinking_budget,
)

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
SUPPORTED_URLS = (CHAT_URL, COMPLETIONS_URL, MESSAGES_URL, EMBEDDINGS_URL)
# Body fields that map straight onto SamplingParams (OpenAI's, plus vLLM's extra sampling knobs).
SAMPLING_FIELDS = frozenset({"n", "temperature", "top_p", "top_k", "min_p", "max_tokens", "min_tokens",
                             "seed", "stop", "stop_token_ids", "presence_penalty", "frequency_penalty",
                             "repetition_penalty", "ignore_eos", "include_stop_str_in_output",
                             "skip_special_tokens", "prompt_logprobs"})
# Tools and thinking (jobs/tool_calls.py): chat lines only.
CHAT_ONLY_FIELDS = ("tools", "tool_choice", "parallel_tool_calls", "reasoning_effort", "chat_template_kwargs",
                    "thinking_token_budget")
# Body fields that change nothing here (or only at their default value, checked below).
IGNORED_FIELDS = frozenset({"model", "user", "metadata", "store", "service_tier", "stream_options",
                            "stream", "echo", "best_of"})
DEFAULT_ONLY = {"stream": False, "echo": False, "best_of": 1}
# Completions take `echo` (the legacy API's: the prompt, and with `logprobs` its tokens' logprobs,
# come back before the completion); chat has no such field.
COMPLETIONS_DEFAULT_ONLY = {name: value for name, value in DEFAULT_ONLY.items() if name != "echo"}
REQUEST_FIELDS = frozenset({"messages", "prompt", "response_format", "max_completion_tokens", "logprobs",
                            "top_logprobs", *CHAT_ONLY_FIELDS})
KNOWN_FIELDS = SAMPLING_FIELDS | IGNORED_FIELDS | REQUEST_FIELDS


class OpenAIBatchRowBuilder:
    def __init__(self, spec: JobSpec, *, limits: ImageLimits | None = None) -> None:
        self.spec = spec
        self.limits = limits or ImageLimits()  # images: read_shard_rows passes the deployment's
        self.default_response_format = engine_response_format(spec.response_format)
        self.messages = AnthropicMessagesRowBuilder(spec, self.default_response_format, limits=self.limits)

    def build(self, line: Line, record: dict[str, Any]) -> Row | RowError:
        custom_id = record.get("custom_id")
        has_custom_id = isinstance(custom_id, str) and bool(custom_id)
        row_id: str = custom_id if isinstance(custom_id, str) and custom_id else str(line.offset)
        try:
            if not has_custom_id:
                raise RowProblem(RowErrorCode.INVALID_ROW, "custom_id must be a non-empty string")
            if record.get("method", "POST") != "POST":
                raise RowProblem(RowErrorCode.UNSUPPORTED_URL, f"method {record.get('method')!r}: only POST")
            url = record.get("url")
            if url not in SUPPORTED_URLS:
                raise RowProblem(RowErrorCode.UNSUPPORTED_URL,
                                 f"url {url!r} is not supported; use {', '.join(SUPPORTED_URLS)}")
            body = record.get("body")
            if not isinstance(body, dict):
                raise RowProblem(RowErrorCode.INVALID_ROW, "body must be an object")
            _check_task(self.spec, url)
            if url == EMBEDDINGS_URL:
                return embedding_row(line.offset, row_id, body, self.spec, line.number)
            if url == MESSAGES_URL:
                return self.messages.row(line.offset, row_id, body, line.number)
            return self._row(line, row_id, url, body)
        except RowProblem as problem:
            return RowError(line.offset, row_id, problem.code, str(problem), line.number)
        except (ValueError, TypeError, RecursionError, OverflowError) as error:  # values no check foresaw
            return unreadable_row(line.offset, row_id, error, line.number)

    def _row(self, line: Line, custom_id: str, url: str, body: dict[str, Any]) -> Row:
        instructions = self.spec.instructions
        default_only = DEFAULT_ONLY if url == CHAT_URL else COMPLETIONS_DEFAULT_ONLY
        unsupported = sorted(
            name for name, value in body.items()
            if name not in KNOWN_FIELDS or (name in default_only and value not in (default_only[name], None)))
        if unsupported:
            raise RowProblem(RowErrorCode.INVALID_ROW, f"body.{unsupported[0]} is not supported here")
        tools, template_kwargs, budget = None, {}, None
        if url == CHAT_URL:
            try:
                tools = openai_tool_request(body)
                template_kwargs = openai_template_kwargs(body)
                budget = thinking_budget(body.get("thinking_token_budget"), "body.thinking_token_budget")
            except ToolProblem as problem:
                raise RowProblem(RowErrorCode.INVALID_ROW, str(problem)) from None
        else:
            given = [name for name in CHAT_ONLY_FIELDS if body.get(name) is not None]
            if given:
                raise RowProblem(RowErrorCode.INVALID_ROW, f"body.{given[0]} needs a chat line ({CHAT_URL}); "
                                 f"{COMPLETIONS_URL} continues a prompt as it is")
        if url == CHAT_URL:
            messages = with_instructions_messages(
                instructions, validate_messages(body.get("messages"), "body.messages", self.limits))
            prompt = None
        else:
            prompt = with_instructions_prompt(instructions, _completion_prompt(body.get("prompt")))
            messages = None
        overrides = {name: body[name] for name in SAMPLING_FIELDS if body.get(name) is not None}
        if body.get("max_completion_tokens") is not None:
            overrides["max_tokens"] = body["max_completion_tokens"]
        logprobs = _logprobs(body, chat=url == CHAT_URL)
        if logprobs is not None:
            overrides["logprobs"] = logprobs
        overrides = parse_sampling_overrides(overrides, "body")
        try:
            sampling = self.spec.sampling.merged(overrides)
        except ValidationError as error:
            raise RowProblem(RowErrorCode.INVALID_SAMPLING, f"body: {first_error_message(error)}") from None
        if url == COMPLETIONS_URL and sampling.max_tokens is None:
            # The completions API's documented default (OpenAI's and vLLM's); chat lines without one
            # generate until the answer ends (jobs/output_tokens.py).
            sampling = sampling.merged({"max_tokens": COMPLETIONS_DEFAULT_MAX_TOKENS})
        echo = body.get("echo") or False
        if not isinstance(echo, bool):
            raise RowProblem(RowErrorCode.INVALID_ROW, f"body.echo must be true or false, got {echo!r}")
        if echo and sampling.logprobs is not None and sampling.prompt_logprobs is None:
            # The legacy API's echo + logprobs: the prompt's tokens come back scored, top-k as asked.
            sampling = sampling.merged({"prompt_logprobs": sampling.logprobs})
        response_format = self.default_response_format
        if body.get("response_format") is not None:
            parsed = parse_response_format(body["response_format"], "body.response_format")
            response_format = engine_response_format(parsed)
        return Row(line.offset, custom_id, prompt, messages, sampling, response_format, {}, line.number,
                   echo=echo, lora=_line_adapter(body.get("model"), self.spec.model), lora_required=False,
                   tools=tools, template_kwargs=template_kwargs, thinking_budget=budget)


def _line_adapter(model: Any, job_model: str) -> str | None:
    """The adapter a line's `body.model` may name (None: the job's model, or no name at all)."""
    if not isinstance(model, str) or not model or model == job_model:
        return None
    return requested_adapter(model, "body.model")


def _check_task(spec: JobSpec, url: str) -> None:
    """One job runs one task: an embeddings line in a generate job (or the reverse) is that row's error."""
    if spec.is_embed and url != EMBEDDINGS_URL:
        raise RowProblem(RowErrorCode.UNSUPPORTED_URL, f"url {url!r} generates text, and this job embeds "
                         f"(task embed): only {EMBEDDINGS_URL} lines run here; put generation lines in a "
                         "job of their own")
    if not spec.is_embed and url == EMBEDDINGS_URL:
        raise RowProblem(RowErrorCode.UNSUPPORTED_URL, f"url {EMBEDDINGS_URL!r} needs an embed job (task "
                         "embed, or a batch created with endpoint /v1/embeddings); this job generates text")


def _completion_prompt(prompt: Any) -> str:
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise RowProblem(RowErrorCode.INVALID_ROW, "body.prompt must be one string (one prompt per line)")
    return prompt


def _logprobs(body: dict[str, Any], chat: bool) -> Any:
    """The vLLM-style count of logprobs to return (validated with the other sampling fields).

    Chat: `logprobs: true` asks for them and `top_logprobs: k` (default 0) for the k most likely
    alternatives; without `logprobs: true`, `top_logprobs` asks for nothing (as OpenAI). Completions:
    `logprobs: k` is the count itself (the chosen token comes back too, as OpenAI documents).
    """
    if chat:
        return body.get("top_logprobs") or 0 if body.get("logprobs") else None
    return body.get("logprobs")


def iter_openai_batch_rows(store: ObjectStore, key: str, start: int, end: int, spec: JobSpec,
                           repeated: dict[int, int] | None = None, *,
                           limits: ImageLimits | None = None) -> Iterator[Row | RowError]:
    """Rows for the lines starting in `[start, end)`; a repeated custom_id fails the later line.
    `repeated`: byte offset -> file line number of the first use, for lines repeating a custom_id
    first used before this range (the plan's whole-file check). `limits`: the images' (default:
    `ImageLimits()`'s)."""
    builder = OpenAIBatchRowBuilder(spec, limits=limits)
    seen: set[str] = set()
    repeated = repeated or {}
    for line in iter_lines_in_range(store, key, start, end):
        if not line.data.strip() and not line.too_long:
            continue
        record = decode_object_line(line)
        if isinstance(record, dict):
            custom_id = record.get("custom_id")
            if isinstance(custom_id, str) and line.offset in repeated:
                yield RowError(line.offset, custom_id, RowErrorCode.DUPLICATE_CUSTOM_ID,
                               f"custom_id {custom_id!r} appears more than once (first on line "
                               f"{repeated[line.offset]} of the file)", line.number)
                continue
            if isinstance(custom_id, str) and custom_id in seen:
                yield RowError(line.offset, custom_id, RowErrorCode.DUPLICATE_CUSTOM_ID,
                               f"custom_id {custom_id!r} appears more than once (line {line.number} of "
                               "the shard)", line.number)
                continue
            if isinstance(custom_id, str):
                seen.add(custom_id)
            yield builder.build(line, record)
            continue
        yield record


def find_duplicate_custom_ids(store: ObjectStore, key: str) -> dict[str, list[int]]:
    """custom_id → byte offsets of every line that repeats it (one streaming pass, ids in memory)."""
    return {custom_id: [offset for offset, _ in lines]
            for custom_id, lines in _repeats(store, key).items()}


def repeated_custom_id_lines(store: ObjectStore, key: str) -> dict[int, int]:
    """Byte offset of every line that repeats an earlier line's custom_id → that earlier line's
    number in the file (one streaming pass over the whole file, ids in memory)."""
    return {offset: first for lines in _repeats(store, key).values() for offset, first in lines}


def _repeats(store: ObjectStore, key: str) -> dict[str, list[tuple[int, int]]]:
    # Ids are remembered as 16-byte digests: a custom_id may be as long as its line (MiBs), and the
    # planner must not hold every one of them.
    first_line: dict[bytes, int] = {}
    repeats: dict[str, list[tuple[int, int]]] = {}
    for line in iter_lines_in_range(store, key, 0, store.head(key).size):
        record = decode_object_line(line) if line.data.strip() else None
        if isinstance(record, dict) and isinstance(record.get("custom_id"), str):
            custom_id = record["custom_id"]
            digest = hashlib.sha256(custom_id.encode("utf-8", "surrogatepass")).digest()[:16]
            if digest in first_line:
                repeats.setdefault(custom_id, []).append((line.offset, first_line[digest]))
            else:
                first_line[digest] = line.number
    return repeats
