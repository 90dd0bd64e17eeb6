"""Verifying drafts: the target samples every drafted position as if the drafts before it were
accepted, and keeps drafts while they equal what it sampled.

The proposals are deterministic (a lookup, or a draft model's greedy token), so the rejection
sampler for them accepts a draft with the target's probability of that token and otherwise draws
from the target's distribution with the draft removed. Drawing the target's token at the position
with the request's own counter-based uniform (engine/sampling_random.py) and accepting when it
equals the draft is exactly that rule: the kept token always has the target's distribution. And
since the draw at output position t is the same draw decoding would make, a row's tokens are the
same with or without speculation, for greedy and for seeded sampling alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bulkinfer.engine.request import Request
from bulkinfer.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class DraftedPosition:
    """A request as the sampler sees it at a drafted position: its first `num_drafts_before`
    drafts taken as output (penalties, min_tokens and the random draw depend on them)."""

    request_id: str
    sampling_params: SamplingParams
    sample_seed: int
    sample_index: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    num_drafts_before: int
    num_output_placeholders: int = 0  # the request's tokens a step in flight is sampling


def sampled_positions(request: Request, drafts: Sequence[int]) -> list[Request | DraftedPosition]:
    """The rows to sample for a request verifying `drafts`: the request itself, then one row per
    draft (after drafts[:j])."""
    rows: list[Request | DraftedPosition] = [request]
    for j in range(1, len(drafts) + 1):
        rows.append(DraftedPosition(
            request.request_id, request.sampling_params, request.sample_seed, request.sample_index,
            request.prompt_token_ids, request.output_token_ids + list(drafts[:j]), j,
            request.num_output_placeholders,
        ))
    return rows


def accepted_tokens(sampled: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """The drafts that equal the target's tokens at their positions, then the target's next token
    (the correction where a draft was rejected, the bonus token when all were accepted)."""
    accepted = 0
    while accepted < len(drafts) and sampled[accepted] == drafts[accepted]:
        accepted += 1
    return list(sampled[: accepted + 1])
