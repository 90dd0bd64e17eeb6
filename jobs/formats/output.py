"""`OutputRow`: one row's outcome, the input of every output writer.

A completed row holds one `Choice` per sample (`n` of them, 1 by default). The row-level `text`,
`json_value` and `finish_reason` are choice 0's, so writers and readers of single-sample jobs see
the shape they always had. Logprobs (when the row asked) live on each choice, one `PositionLogprobs`
per output token, in an engine-neutral form the writers shape for their format.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from bulkinfer.jobs.formats.rows import Row, RowError, RowErrorCode


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    token: str  # the token's text (U+FFFD where it holds part of a UTF-8 character)
    logprob: float
    bytes: list[int]  # the token's exact UTF-8 bytes

    def as_record(self) -> dict[str, Any]:
        return {"token": self.token, "token_id": self.token_id, "logprob": self.logprob, "bytes": self.bytes}


@dataclass(frozen=True, slots=True)
class PositionLogprobs:
    """One output position: the sampled token and the `logprobs` most likely ones (most likely first)."""

    chosen: TokenLogprob
    top: list[TokenLogprob]

    def as_record(self) -> dict[str, Any]:
        """Our JSONL/Parquet shape: the chosen token's fields plus `top_logprobs`."""
        return {**self.chosen.as_record(), "top_logprobs": [entry.as_record() for entry in self.top]}


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """A row's prompt, scored (`prompt_logprobs`): its first token, which nothing precedes to score
    it, then one `PositionLogprobs` per later prompt token (`chosen` is the prompt's own token)."""

    first_token_id: int
    first_token: str
    first_bytes: list[int]
    positions: list[PositionLogprobs]

    def as_records(self) -> list[dict[str, Any] | None]:
        """vLLM's shape: null for the first token, then each later one's record."""
        return [None, *(position.as_record() for position in self.positions)]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A function call the model made: `id` is stable for the row (OpenAI's `call_…`; Anthropic's
    `tool_use` block takes it as `toolu_…`), `arguments` the parsed object."""

    id: str
    name: str
    arguments: dict[str, Any]

    def as_record(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "arguments": self.arguments}


@dataclass(frozen=True, slots=True)
class Choice:
    """One sample of a row. `json_value` is the parsed text when the row asked for JSON.
    `stop_reason`: the stop string or stop token id that ended it (None at EOS or max_tokens), as
    vLLM reports it; it tells an Anthropic `stop_sequence` from an `end_turn`. `text` is the answer:
    a thinking model's thinking is `reasoning`, and calls are `tool_calls` (finish_reason
    `tool_calls`)."""

    index: int
    text: str
    finish_reason: str
    logprobs: list[PositionLogprobs] | None = None
    json_value: Any = None
    stop_reason: str | int | None = None
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True, slots=True)
class OutputRow:
    """A completed row (`text` set) or a failed one (`error_code` set); a completed row whose text
    should have been JSON but is not carries both.
    """

    index: int
    row_id: str
    is_chat: bool = False
    wants_json: bool = False
    text: str | None = None
    json_value: Any = None
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    error_code: str | None = None
    error_message: str | None = None
    passthrough: dict[str, Any] = field(default_factory=dict)
    line: int | None = None  # JSONL: the line number within the shard
    choices: tuple[Choice, ...] = ()  # every sample of a completed row; choice 0 is `text` above
    deduplicated: bool = False  # took the output of an identical deterministic row of its shard
    engine_seconds: float = 0.0  # engine step time attributed to the row (0 for a deduplicated copy)
    # Speculative decoding: drafts verified / accepted at each draft position (empty without).
    drafted_per_position: tuple[int, ...] = ()
    accepted_per_position: tuple[int, ...] = ()
    # An embed row's vectors (float32), one per input in order; None for generated rows and failures.
    embeddings: tuple[array, ...] | None = None
    encoding_format: str = "float"  # how an OpenAI body carries them: "float" or "base64"
    prompt_logprobs: PromptLogprobs | None = None  # when the row asked (prompt_logprobs)
    echo_prompt: str | None = None  # the prompt, where the row asked to have it echoed (OpenAI `echo`)
    lora: str | None = None  # the LoRA adapter the row ran on (its usage is that adapter's); None: the base
    # How its prompt was rendered: chat_template, chatml or raw (None: it never reached the engine).
    prompt_format: str | None = None
    reasoning_tokens: int = 0  # of completion_tokens, those a thinking model spent thinking

    @property
    def reasoning(self) -> str | None:
        """Choice 0's thinking (None: the model did not think, or the request did not ask for it)."""
        return self.choices[0].reasoning if self.choices else None

    @property
    def tool_calls(self) -> tuple[ToolCall, ...]:
        """Choice 0's calls."""
        return self.choices[0].tool_calls if self.choices else ()

    @property
    def failed(self) -> bool:
        return self.error_code is not None

    @property
    def logprobs(self) -> list[PositionLogprobs] | None:
        """Choice 0's logprobs; None when the row did not ask for them."""
        return self.choices[0].logprobs if self.choices else None

    @property
    def stop_reason(self) -> str | int | None:
        """Choice 0's stop string or stop token id; None when it ended otherwise (or failed)."""
        return self.choices[0].stop_reason if self.choices else None

    @classmethod
    def completed(cls, row: Row, text: str, finish_reason: str, *, prompt_tokens: int, cached_tokens: int,
                  completion_tokens: int, logprobs: list[PositionLogprobs] | None = None) -> OutputRow:
        """The engine's single answer for `row`; parses it when the row asked for JSON."""
        return cls.with_choices(row, [Choice(0, text, finish_reason, logprobs)], prompt_tokens=prompt_tokens,
                                cached_tokens=cached_tokens, completion_tokens=completion_tokens)

    @classmethod
    def with_choices(cls, row: Row, choices: Sequence[Choice], *, prompt_tokens: int, cached_tokens: int,
                     completion_tokens: int, engine_seconds: float = 0.0,
                     drafted_per_position: tuple[int, ...] = (),
                     accepted_per_position: tuple[int, ...] = (),
                     prompt_logprobs: PromptLogprobs | None = None) -> OutputRow:
        """The engine's `n` answers for `row` (`completion_tokens` counts them all); each is parsed
        when the row asked for JSON, and one that does not parse makes the row INVALID_OUTPUT_JSON
        (its text is kept)."""
        if not choices:
            raise ValueError("a completed row needs at least one choice")
        wants_json = row.response_format is not None  # readers leave plain-text formats out
        error_code, error_message = None, None
        if wants_json:
            parsed = []
            for choice in choices:
                if choice.tool_calls and not choice.text:  # it called a function instead of answering
                    parsed.append(choice)
                    continue
                value, problem = _parse_json(choice.text)
                if problem is not None and error_code is None:
                    error_code = RowErrorCode.INVALID_OUTPUT_JSON.value
                    where = f"choice {choice.index}: " if len(choices) > 1 else ""
                    error_message = (f"{where}the output is not valid JSON ({problem}; "
                                     f"finish_reason={choice.finish_reason})")
                parsed.append(replace(choice, json_value=value))
            choices = parsed
        first = choices[0]
        return cls(row.index, row.row_id, row.is_chat, wants_json, first.text, first.json_value,
                   first.finish_reason, prompt_tokens, cached_tokens, completion_tokens, error_code,
                   error_message, row.passthrough, row.line, tuple(choices), engine_seconds=engine_seconds,
                   drafted_per_position=drafted_per_position, accepted_per_position=accepted_per_position,
                   prompt_logprobs=prompt_logprobs, echo_prompt=row.prompt if row.echo else None)

    @classmethod
    def embedded(cls, row: Row, vectors: Sequence[array], *, prompt_tokens: int,
                 engine_seconds: float = 0.0) -> OutputRow:
        """An embed row's vectors (already shortened to its `dimensions`); no completion tokens."""
        encoding = row.embed.encoding_format if row.embed is not None else "float"
        return cls(row.index, row.row_id, prompt_tokens=prompt_tokens, cached_tokens=0, completion_tokens=0,
                   passthrough=row.passthrough, line=row.line, engine_seconds=engine_seconds,
                   embeddings=tuple(vectors), encoding_format=encoding, prompt_format="raw")

    @classmethod
    def from_error(cls, error: RowError) -> OutputRow:
        """A row the reader could not build."""
        return cls(error.index, error.row_id, error_code=error.code.value, error_message=error.message,
                   passthrough=error.passthrough, line=error.line)

    @classmethod
    def engine_failed(cls, row: Row, code: RowErrorCode, message: str) -> OutputRow:
        """A row the engine refused or failed (too long a prompt, a grammar that does not compile)."""
        return cls(row.index, row.row_id, row.is_chat, error_code=code.value, error_message=message,
                   passthrough=row.passthrough, line=row.line)


EXPIRED_MESSAGE = "the job's completion_window passed before the row finished"


def expired_row(item: Row | RowError) -> OutputRow:
    """The outcome of a row its job's deadline caught before it finished (a row that could not
    run anyway keeps its own error)."""
    if isinstance(item, RowError):
        return OutputRow.from_error(item)
    return OutputRow.engine_failed(item, RowErrorCode.EXPIRED, EXPIRED_MESSAGE)


def _parse_json(text: str) -> tuple[Any, str | None]:
    # Strict, as users will parse it: the engine rewrites schemas so that xgrammar cannot emit raw
    # control characters in strings (mlc-ai/xgrammar#800, docs/structured-output.md).
    try:
        return json.loads(text), None
    except json.JSONDecodeError as error:
        return None, error.msg
