"""Prompt logprobs (vLLM's ``prompt_logprobs``): the log-probability of each prompt token after the
first, and the top-k alternatives, from the same forward pass that prefills the prompt.

Prompt token p + 1 is scored by the logits at position p, so a chunk computing positions
[start, end) scores the prompt positions in it below the last prompt token, from the request's
first unscored one (``Request.num_prompt_logprobs``): a chunk after a preemption recomputes
positions already scored and scores none twice. The LM head runs in fp32 on those rows, a slice
of rows at a time so a long prompt never holds [prompt, vocab] logits at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from bulkinfer.engine.request import Request
from bulkinfer.engine.sampler import RowLogprobs
from bulkinfer.engine.scheduler import ScheduledChunk

# Rows whose fp32 logits and log-softmax are held at once (256 x 49,152 vocab x 4 B = 48 MiB each).
ROWS_PER_SLICE = 256


@dataclass(frozen=True, slots=True)
class ScoreSpan:
    """Prompt positions [first, first + count) of one request that a step scores; `offset`: where
    `first` is within the chunk's tokens."""

    request: Request
    first: int
    count: int
    offset: int


def score_span(chunk: ScheduledChunk) -> ScoreSpan | None:
    """The prompt positions this chunk scores, or None."""
    request = chunk.request
    if chunk.spec_token_ids or not request.needs_prompt_logprobs:
        return None
    first = max(chunk.start, request.num_prompt_logprobs)
    end = min(chunk.start + chunk.num_new_tokens, request.num_prompt_tokens - 1)
    if end <= first:
        return None
    return ScoreSpan(request, first, end - first, first - chunk.start)


def score_rows(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, spans: list[ScoreSpan],
               num_rows: int, softcap: float | None = None) -> dict[str, list[RowLogprobs]]:
    """Each span's prompt logprobs from the final hidden states of its positions (`hidden` holds
    the spans' rows in order), by request id. `head`: fp32 logits of hidden rows; `softcap`: the
    model's final-logit soft-cap (Gemma: logits = cap * tanh(logits / cap)), None for none. A
    tensor-parallel rank other than 0 has no spans (it does not sample): it runs `head` over the
    same `num_rows` in the same slices (its part of the gather), and gets nothing back."""
    if not spans:
        for begin in range(0, num_rows, ROWS_PER_SLICE):
            head(hidden[begin : begin + ROWS_PER_SLICE])
        return {}
    targets: list[int] = []
    ks: list[int] = []
    for span in spans:
        prompt = span.request.prompt_token_ids
        targets.extend(prompt[span.first + 1 : span.first + 1 + span.count])
        k = span.request.sampling_params.prompt_logprobs or 0
        ks.extend([k] * span.count)
    rows: list[RowLogprobs] = []
    for begin in range(0, len(targets), ROWS_PER_SLICE):
        end = begin + ROWS_PER_SLICE
        logits = head(hidden[begin:end])
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        rows.extend(_slice_logprobs(logits, targets[begin:end], ks[begin:end]))
    result: dict[str, list[RowLogprobs]] = {}
    at = 0
    for span in spans:
        result[span.request.request_id] = rows[at : at + span.count]
        at += span.count
    return result


def _slice_logprobs(logits: torch.Tensor, targets: list[int], ks: list[int]) -> list[RowLogprobs]:
    logprobs = torch.log_softmax(logits, dim=-1)
    target = torch.tensor(targets, device=logprobs.device)[:, None]
    chosen_t = logprobs.gather(1, target)
    chosen = chosen_t[:, 0].tolist()
    ranks = ((logprobs > chosen_t).sum(dim=-1) + 1).tolist()  # 1 = the most likely token
    max_k = max(ks)
    if max_k:
        top = logprobs.topk(max_k, dim=-1)
        top_ids, top_values = top.indices.tolist(), top.values.tolist()
    else:
        top_ids = top_values = [[] for _ in targets]
    return [
        RowLogprobs(token_id, value, ids[:k], values[:k], rank)
        for token_id, value, ids, values, k, rank in zip(targets, chosen, top_ids, top_values, ks, ranks,
                                                         strict=True)
    ]
