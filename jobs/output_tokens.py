"""How many tokens a row may generate (the bound) and how many it is expected to (the estimate).

- **The bound.** A row that sets no `max_tokens` generates until it stops (EOS or a stop string),
  bounded by the model's context and the deployment's `max_tokens_cap`, as OpenAI's chat API and
  vLLM's OpenAI server do: published batch code leaves `max_tokens` out and means "the whole answer".
  OpenAI `/v1/completions` lines keep that API's documented default of 16 (vLLM's completions route
  has it too). A row or job asking for more than the cap is refused, naming the cap.
- **The estimate.** Planning (shard sizes, the fair queue's charge, a dry run's run time) needs what
  rows will generate, not the bound: per row `min(max_tokens, the model's expected output length) x n`.
  The expected length is measured: the mean completion tokens of the model's samples that ended on
  their own (a sample cut at its max_tokens only says the answer is longer), kept per model in Redis;
  before enough of them, the `output_tokens_estimate` setting.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from bulkinfer.jobs.sampling import JobSampling

if TYPE_CHECKING:  # the SDK imports jobs modules and installs without redis
    import redis

    from bulkinfer.jobs.formats.output import OutputRow

DEFAULT_MAX_TOKENS_CAP = 16_384
DEFAULT_OUTPUT_TOKENS_ESTIMATE = 256
# OpenAI's legacy completions API: "max_tokens ... Defaults to 16" (vLLM's /v1/completions: the same).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# Samples that ended on their own before the measured mean replaces the setting.
MIN_MEASURED_SAMPLES = 8
# Finish reasons of a sample that ended on its own (EOS, a stop string or stop token).
NATURAL_FINISH_REASONS = frozenset({"stop"})


def max_tokens_problem(max_tokens: int | None, cap: int, where: str = "max_tokens") -> str | None:
    """Why `max_tokens` cannot run on this deployment (above its cap), or None."""
    if max_tokens is not None and max_tokens > cap:
        return (f"{where} {max_tokens} is more than this deployment's max_tokens_cap ({cap}); ask for at "
                f"most {cap}, or leave max_tokens out to generate until the answer ends")
    return None


def expected_tokens_per_row(sampling: JobSampling, expected_output: int) -> int:
    """What one row is expected to generate: its max_tokens (0: scoring only) or the model's
    expected output length, whichever is less, times its samples."""
    limit = sampling.max_tokens
    tokens = expected_output if limit is None else min(limit, expected_output)
    return tokens * (sampling.n or 1)


def most_tokens_per_row(sampling: JobSampling, cap: int) -> int:
    """The most one row may generate: its max_tokens, else the cap, times its samples."""
    return (cap if sampling.max_tokens is None else sampling.max_tokens) * (sampling.n or 1)


@dataclass(frozen=True)
class OutputLengths:
    """A model's output lengths on this deployment: what a row without max_tokens is expected to
    generate, and the most any row may."""

    expected: int = DEFAULT_OUTPUT_TOKENS_ESTIMATE
    cap: int = DEFAULT_MAX_TOKENS_CAP

    def expected_per_row(self, sampling: JobSampling) -> int:
        return expected_tokens_per_row(sampling, self.expected)

    def most_per_row(self, sampling: JobSampling) -> int:
        return most_tokens_per_row(sampling, self.cap)


@dataclass(frozen=True)
class NaturalLengths:
    """Samples that ended on their own and the completion tokens they took."""

    samples: int = 0
    tokens: int = 0

    @classmethod
    def of(cls, outputs: Sequence[OutputRow]) -> NaturalLengths:
        """Over rows the engine computed (a deduplicated copy is its source again); a row's tokens
        are split evenly over its samples (the engine counts them per row)."""
        samples = tokens = 0
        for row in outputs:
            if row.deduplicated or not row.choices or not row.completion_tokens:
                continue
            per_sample = row.completion_tokens / len(row.choices)
            natural = sum(choice.finish_reason in NATURAL_FINISH_REASONS for choice in row.choices)
            samples += natural
            tokens += round(per_sample * natural)
        return cls(samples, tokens)


def lengths_key(namespace: str, model: str) -> str:
    return f"{namespace}:output_lengths:{model}"


def record_natural_lengths(client: redis.Redis, namespace: str, model: str, lengths: NaturalLengths) -> None:
    """Add a committed shard's natural output lengths to the model's (no expiry: like its measured
    throughput, it outlives a scaled-to-zero worker)."""
    if lengths.samples:
        with client.pipeline(transaction=True) as pipeline:
            pipeline.hincrby(lengths_key(namespace, model), "samples", lengths.samples)
            pipeline.hincrby(lengths_key(namespace, model), "tokens", lengths.tokens)
            pipeline.execute()


def expected_output_tokens(client: redis.Redis, namespace: str, model: str, default: int) -> int:
    """The model's measured mean output length (at least 1), or `default` before enough samples."""
    raw = client.hgetall(lengths_key(namespace, model))
    values = {(key.decode() if isinstance(key, bytes) else key): int(value) for key, value in raw.items()}
    samples = values.get("samples", 0)
    if samples < MIN_MEASURED_SAMPLES:
        return default
    return max(1, round(values.get("tokens", 0) / samples))
