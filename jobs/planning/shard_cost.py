"""What a shard costs the engine, in tokens, estimated when the job is planned; and shard sizes
bounded by it.

The fair queue (jobs/fair_queue.py) charges each tenant the tokens of the shards it is given, not
their rows: a row asking for 16 samples of 512 tokens is 16 x 512 tokens of decoding, a row asking
for one sample of 16 tokens is 16, and charging both "one row" lets a tenant take most of the
engine while the queue thinks it had its share. A shard's tokens are its prompt tokens (JSONL: the
bytes of its lines / BYTES_PER_TOKEN, which overcounts a little for the JSON around the prompt;
Parquet: a nominal figure per row) plus, per row, what it is expected to generate: `max_tokens` or
the model's expected output length, whichever is less, x `n` (jobs/output_tokens.py: a row without
max_tokens may generate up to the model's context, and charging that bound would price every such
job like the longest answer). Per-row sampling overrides are not known before the rows are read; the
job's sampling counts.

The planner bounds shards the same way (`max_shard_size` rows, `max_shard_tokens` tokens): a shard
is the unit a worker slot is given, so its size bounds how long a small job that arrives waits for a
free slot, whatever the job ahead of it asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from bulkinfer.jobs.object_store.base import ObjectStore
from bulkinfer.jobs.output_tokens import DEFAULT_OUTPUT_TOKENS_ESTIMATE, expected_tokens_per_row
from bulkinfer.jobs.planning.sharding import ShardPlan, plan_ranges, with_file_checks
from bulkinfer.jobs.spec import JobSpec

if TYPE_CHECKING:
    from bulkinfer.jobs.settings import Settings

BYTES_PER_TOKEN = 4  # about what BPE tokenizers give for English text
PARQUET_PROMPT_TOKENS_PER_ROW = 64  # a Parquet shard's size in bytes is not known when it is planned


def shard_prompt_tokens(shard: ShardPlan) -> int:
    if shard.byte_start is not None and shard.byte_end is not None:
        return (shard.byte_end - shard.byte_start) // BYTES_PER_TOKEN
    return shard.estimated_rows * PARQUET_PROMPT_TOKENS_PER_ROW


def shard_token_cost(shard: ShardPlan, spec: JobSpec,
                     expected_output: int = DEFAULT_OUTPUT_TOKENS_ESTIMATE) -> int:
    """The shard's estimated prompt tokens plus the completion tokens its rows are expected to
    generate (`expected_output`: the model's expected output length), at least 1: what the fair
    queue charges its tenant and job."""
    rows = len(shard.only_rows) if shard.only_rows is not None else shard.estimated_rows
    prompt = shard_prompt_tokens(shard)
    if shard.only_rows is not None and shard.estimated_rows:  # a retry runs some rows of the range
        prompt = prompt * rows // shard.estimated_rows
    return max(1, prompt + rows * expected_tokens_per_row(spec.sampling, expected_output))


def bounded_shard_size(size: int, max_shard_tokens: int, tokens_per_row: float) -> int:
    """Rows per shard: `size` (the job's `shard_size`, cut to `max_shard_size`), cut to as many rows
    as fit in `max_shard_tokens` at `tokens_per_row` (at least one row)."""
    if tokens_per_row * size > max_shard_tokens:
        size = max(1, int(max_shard_tokens // tokens_per_row))
    return size


def plan_bounded(plan_with_size: Callable[[int], Sequence[ShardPlan]], spec: JobSpec, max_shard_size: int,
                 max_shard_tokens: int,
                 expected_output: int = DEFAULT_OUTPUT_TOKENS_ESTIMATE) -> list[ShardPlan]:
    """The plan, with shards no bigger than the bounds allow: `plan_with_size(rows)` plans the input
    (jobs/planning/sharding.py); when the rows it finds cost more tokens each than one shard may hold at that
    size, the input is planned again with smaller shards."""
    size = min(spec.shard_size, max_shard_size)
    plan = list(plan_with_size(size))
    rows = sum(shard.estimated_rows for shard in plan)
    if rows == 0:
        return plan
    tokens_per_row = sum(shard_token_cost(shard, spec, expected_output) for shard in plan) / rows
    bounded = bounded_shard_size(size, max_shard_tokens, tokens_per_row)
    return list(plan_with_size(bounded)) if bounded < size else plan


def plan_within_bounds(settings: Settings, store: ObjectStore, key: str, spec: JobSpec,
                       expected_output: int = DEFAULT_OUTPUT_TOKENS_ESTIMATE) -> list[ShardPlan]:
    """`plan_shards` with the deployment's `max_shard_size` and `max_shard_tokens`: a job asking for
    bigger shards gets more, smaller ones (its `shard_size` is an upper bound). `expected_output`:
    the model's expected output length (`expected_output_tokens`). The checks across the whole file
    run once, on the final plan."""
    def plan_with_size(rows: int) -> list[ShardPlan]:
        return plan_ranges(store, key, spec.model_copy(update={"shard_size": rows}))

    plan = plan_bounded(plan_with_size, spec, settings.max_shard_size, settings.max_shard_tokens,
                        expected_output)
    return with_file_checks(store, key, spec, plan)
