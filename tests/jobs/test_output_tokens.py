"""What a row may generate and what planning expects it to: jobs/output_tokens.py."""

from __future__ import annotations

import redis

from bulkinfer.jobs.formats.output import Choice, OutputRow
from bulkinfer.jobs.output_tokens import (
    DEFAULT_OUTPUT_TOKENS_ESTIMATE,
    MIN_MEASURED_SAMPLES,
    NaturalLengths,
    OutputLengths,
    expected_output_tokens,
    max_tokens_problem,
    record_natural_lengths,
)
from bulkinfer.jobs.sampling import JobSampling


def _row(*reasons: str, tokens: int, deduplicated: bool = False) -> OutputRow:
    choices = tuple(Choice(index, "x", reason) for index, reason in enumerate(reasons))
    return OutputRow(0, "r", text="x", finish_reason=reasons[0], completion_tokens=tokens, choices=choices,
                     deduplicated=deduplicated)


def test_only_samples_that_ended_on_their_own_measure_the_models_output_length() -> None:
    lengths = NaturalLengths.of([
        _row("stop", tokens=40),
        _row("length", tokens=16),  # cut at its max_tokens: only says the answer is longer
        _row("stop", "length", tokens=60),  # two samples of 30: one ended on its own
        _row("stop", tokens=40, deduplicated=True),  # a copy: its source counted it
        OutputRow(0, "e", error_code="invalid_row", error_message="bad"),
    ])
    assert lengths == NaturalLengths(samples=2, tokens=70)


def test_the_expected_length_is_the_setting_until_the_model_has_measured_enough(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    assert expected_output_tokens(client, "ns", "m", 300) == 300
    record_natural_lengths(client, "ns", "m", NaturalLengths(MIN_MEASURED_SAMPLES - 1, 70))
    assert expected_output_tokens(client, "ns", "m", 300) == 300
    record_natural_lengths(client, "ns", "m", NaturalLengths(1, 10))
    assert expected_output_tokens(client, "ns", "m", 300) == 10  # 80 tokens over 8 samples
    assert expected_output_tokens(client, "ns", "other", 300) == 300  # per model


def test_planning_counts_the_expected_length_and_the_bound_the_cap() -> None:
    lengths = OutputLengths(expected=90, cap=4096)
    unset, short, scoring = JobSampling(), JobSampling(max_tokens=20, n=3), JobSampling(max_tokens=0)
    assert (lengths.expected_per_row(unset), lengths.most_per_row(unset)) == (90, 4096)
    assert (lengths.expected_per_row(short), lengths.most_per_row(short)) == (60, 60)
    assert (lengths.expected_per_row(scoring), lengths.most_per_row(scoring)) == (0, 0)
    assert OutputLengths().expected == DEFAULT_OUTPUT_TOKENS_ESTIMATE


def test_asking_past_the_cap_names_it() -> None:
    assert max_tokens_problem(None, 100) is None and max_tokens_problem(100, 100) is None
    problem = max_tokens_problem(101, 100) or ""
    assert "max_tokens 101 is more than this deployment's max_tokens_cap (100)" in problem
