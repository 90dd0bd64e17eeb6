"""What speculation did: drafts proposed and accepted, overall and per draft position."""

from __future__ import annotations

from typing import Any


def add_outcome(drafted: list[int], accepted: list[int], num_drafts: int, num_accepted: int) -> None:
    """Count one verification into per-position lists (grown to `num_drafts` if shorter)."""
    for counts in (drafted, accepted):
        if len(counts) < num_drafts:
            counts.extend([0] * (num_drafts - len(counts)))
    for position in range(num_drafts):
        drafted[position] += 1
    for position in range(num_accepted):
        accepted[position] += 1


class SpeculationStats:
    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_verifications = 0  # request-steps that verified at least one draft
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.drafted_per_position = [0] * num_speculative_tokens
        self.accepted_per_position = [0] * num_speculative_tokens
        self.steps_on = 0  # steps in which requests proposed drafts
        self.steps_off = 0  # steps the gate kept speculation off

    def record(self, num_drafts: int, num_accepted: int) -> None:
        if num_drafts <= 0:
            return
        self.num_verifications += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        add_outcome(self.drafted_per_position, self.accepted_per_position, num_drafts, num_accepted)

    def snapshot(self) -> dict[str, Any]:
        drafted, accepted = self.num_draft_tokens, self.num_accepted_tokens
        return {
            "num_verifications": self.num_verifications,
            "num_draft_tokens": drafted,
            "num_accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            # Tokens per verification: the accepted drafts plus the token the target adds.
            "mean_accepted_length": 1 + accepted / self.num_verifications if self.num_verifications else 0.0,
            "acceptance_rate_per_position": [
                a / d if d else 0.0
                for a, d in zip(self.accepted_per_position, self.drafted_per_position, strict=True)
            ],
            "drafted_per_position": list(self.drafted_per_position),
            "accepted_per_position": list(self.accepted_per_position),
            "steps_on": self.steps_on,
            "steps_off": self.steps_off,
        }
