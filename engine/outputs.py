"""What the engine hands back: one RequestOutput per request, one CompletionOutput per sample."""

from __future__ import annotations

from dataclasses import dataclass, field

from bulkinfer.engine.errors import ErrorKind
from bulkinfer.engine.metrics import RequestMetrics


@dataclass
class TokenLogprob:
    token_id: int
    token: str  # the token's text (U+FFFD where it holds part of a UTF-8 character)
    logprob: float
    bytes: list[int]  # the token's exact UTF-8 bytes
    rank: int | None = None  # its rank in the model's distribution (1: the most likely)


@dataclass
class PositionLogprobs:
    """Log-probabilities at one output position, from the model's raw log-softmax."""

    chosen: TokenLogprob  # the token that was sampled (for a prompt position: the prompt's token)
    top: list[TokenLogprob]  # the `logprobs` most likely tokens, most likely first


@dataclass
class CompletionOutput:
    """One sample (of `n`) of a request."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort", "error"
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    logprobs: list[PositionLogprobs] | None = None  # one per output token when asked for


@dataclass
class RequestOutput:
    """A finished request. `text`, `token_ids` and `finish_reason` are `outputs[0]`'s;
    `num_completion_tokens` counts the tokens of all `n` outputs."""

    request_id: str
    prompt: str | None  # the text given, or None when the prompt was token ids
    prompt_token_ids: list[int]
    text: str  # output tokens detokenized
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort", "error"
    error: str | None  # why, in words (finish_reason "error")
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served by the prefix cache (first sample's)
    num_completion_tokens: int
    metrics: RequestMetrics | None
    finished: bool = True
    outputs: list[CompletionOutput] = field(default_factory=list)
    # Why, as a code (engine/errors.py): what callers branch on; a host may set its own (a worker's
    # "lora_refused").
    error_kind: ErrorKind | str | None = None
    # With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (nothing
    # precedes it), then its logprob given the tokens before it and the top-k alternatives.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    lora_name: str | None = None  # the LoRA adapter it ran with (None: the base model)
