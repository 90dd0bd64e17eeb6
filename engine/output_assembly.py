"""Output assembly: finished samples become ``CompletionOutput``s, a request's samples one ``RequestOutput``.

``Parent`` (a request as the caller sees it) and ``Sample`` (one scheduled sequence of it) are the
engine's per-request records; ``OutputAssembler`` turns them into outputs (text, logprobs, metrics).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from bulkinfer.engine.detokenizer import IncrementalDetokenizer
from bulkinfer.engine.metrics import RequestMetrics
from bulkinfer.engine.outputs import CompletionOutput, PositionLogprobs, RequestOutput, TokenLogprob
from bulkinfer.engine.request import FinishReason, Request
from bulkinfer.engine.sampler import RowLogprobs
from bulkinfer.engine.token_bytes import TokenBytes


@dataclass(eq=False)
class Parent:
    """A request as the caller sees it: one prompt, n samples."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    outputs: dict[int, CompletionOutput] = dataclasses.field(default_factory=dict)
    # prompt_logprobs: the scored positions so far (prompt tokens 1..), from the first sample.
    prompt_logprobs: list[RowLogprobs] | None = None
    lora_name: str | None = None  # the adapter it ran with


@dataclass(eq=False)
class Sample:
    """Engine-side state of one scheduled sequence (one sample of a parent)."""

    parent: Parent
    request: Request
    detokenizer: IncrementalDetokenizer | None  # only with stop strings
    logprobs: list[RowLogprobs] | None
    structured: bool


def text_includes_last_token(request: Request) -> bool:
    """A stop token (EOS or stop id) is left out of the text, as in vLLM."""
    return not request.stopped_on_token or request.sampling_params.include_stop_str_in_output


class OutputAssembler:
    """Builds the outputs of finished samples and requests with the engine's tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._token_bytes: TokenBytes | None = None  # built on the first request with logprobs

    def completion(self, sample: Sample) -> CompletionOutput:
        """The output of one finished sample."""
        request = sample.request
        params = request.sampling_params
        if sample.detokenizer is not None:
            stop = sample.detokenizer.finish()  # flush an incomplete trailing character
            if stop is not None and request.finish_reason is not FinishReason.STOP:
                request.finish_reason, request.stop_reason = FinishReason.STOP, stop
            text = sample.detokenizer.text
        else:
            token_ids = request.output_token_ids
            if token_ids and not text_includes_last_token(request):
                token_ids = token_ids[:-1]
            text = self._tokenizer.decode(token_ids, skip_special_tokens=params.skip_special_tokens)
        return CompletionOutput(
            index=request.sample_index,
            text=text if request.output_token_ids else "",
            token_ids=list(request.output_token_ids),
            finish_reason=str(request.finish_reason) if request.finish_reason is not None else None,
            stop_reason=request.stop_reason,
            logprobs=self._position_logprobs(sample.logprobs) if sample.logprobs is not None else None,
        )

    def prompt_logprobs(self, parent: Parent) -> list[PositionLogprobs | None] | None:
        """The request's prompt logprobs: None for the first prompt token, then one per scored one."""
        if parent.prompt_logprobs is None:
            return None
        return [None, *self._position_logprobs(parent.prompt_logprobs)]

    def _position_logprobs(self, rows: list[RowLogprobs]) -> list[PositionLogprobs]:
        if self._token_bytes is None:
            self._token_bytes = TokenBytes(self._tokenizer)
        token_bytes = self._token_bytes

        def entry(token_id: int, logprob: float, rank: int | None) -> TokenLogprob:
            text, raw = token_bytes.get(token_id)
            return TokenLogprob(token_id, text, logprob, raw, rank)

        return [
            PositionLogprobs(
                chosen=entry(row.token_id, row.chosen, row.rank),
                top=[entry(t, lp, i + 1) for i, (t, lp) in enumerate(zip(row.top_ids, row.top_logprobs,
                                                                          strict=True))],
            )
            for row in rows
        ]


def parent_output(parent: Parent, prompt_logprobs: list[PositionLogprobs | None] | None = None
                  ) -> RequestOutput | None:
    """The request's output once every sample has its completion; None before."""
    if len(parent.outputs) < len(parent.children):
        return None
    outputs = [parent.outputs[i] for i in range(len(parent.children))]
    first = parent.children[0]
    failed = next((c for c in parent.children if c.error is not None), None)
    error, error_kind = (failed.error, failed.error_kind) if failed is not None else (None, None)
    return RequestOutput(
        request_id=parent.request_id,
        prompt=parent.prompt,
        prompt_token_ids=list(parent.prompt_token_ids),
        text=outputs[0].text,
        token_ids=outputs[0].token_ids,
        finish_reason=outputs[0].finish_reason,
        error=error,
        error_kind=error_kind,
        num_prompt_tokens=first.num_prompt_tokens,
        num_cached_tokens=first.num_cached_tokens,
        num_completion_tokens=sum(len(o.token_ids) for o in outputs),
        metrics=RequestMetrics.merged([RequestMetrics.from_request(c) for c in parent.children]),
        finished=all(c.is_finished for c in parent.children),
        outputs=outputs,
        prompt_logprobs=prompt_logprobs,
        lora_name=parent.lora_name,
    )


def rejection_output(parent: Parent, n: int) -> RequestOutput:
    """The output of a request rejected before it ran: its first child's error, n empty completions."""
    request = parent.children[0]
    completion = CompletionOutput(0, "", [], str(FinishReason.ERROR))
    return RequestOutput(
        request_id=parent.request_id,
        prompt=parent.prompt,
        prompt_token_ids=list(parent.prompt_token_ids),
        text="",
        token_ids=[],
        finish_reason=str(FinishReason.ERROR),
        error=request.error,
        error_kind=request.error_kind,
        num_prompt_tokens=request.num_prompt_tokens,
        num_cached_tokens=0,
        num_completion_tokens=0,
        metrics=RequestMetrics.from_request(request),
        finished=True,
        outputs=[dataclasses.replace(completion, index=i) for i in range(n)],
        lora_name=parent.lora_name,
    )
