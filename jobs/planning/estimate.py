"""A dry run's estimate: what a job would compute, and about how long it would take here.

Rows are read as a worker reads them (`read_shard_rows`, shard by shard), up to `max_rows` (the rest
extrapolated from the plan's row count). Prompt tokens are counted with the model's own tokenizer
(jobs/tokenizer_files.py). Rows a shard would run once (identical deterministic prompt and sampling,
the worker's deduplication) are counted apart; tokens that rows share as a prefix (the instructions
above all) are counted in whole 16-token KV blocks, as the prefix cache reuses them. Output tokens
are counted twice: the most rows may generate (max_tokens, else the deployment's max_tokens_cap) and
what they are expected to (jobs/output_tokens.py: the model's measured output length where max_tokens
allows it). The run time is tokens to compute (prompt tokens not in a shared prefix, plus the
expected output) over the throughput this deployment's workers measured for the model (tokens
computed per engine-busy second, jobs/workers.py), shared by the live workers serving it; "unknown"
when none has measured it yet.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from itertools import islice

from bulkinfer.jobs.formats.readers import read_shard_rows
from bulkinfer.jobs.formats.rows import Row, RowError
from bulkinfer.jobs.lora_adapters import UnknownAdapter
from bulkinfer.jobs.model_registry import ModelRegistry
from bulkinfer.jobs.object_store.base import ObjectStore
from bulkinfer.jobs.output_tokens import OutputLengths
from bulkinfer.jobs.planning.estimate_report import JobEstimate
from bulkinfer.jobs.planning.job_dedup import row_key
from bulkinfer.jobs.planning.sharding import ShardPlan
from bulkinfer.jobs.spec import JobSpec
from bulkinfer.jobs.tokenizer_files import PublishedTokenizer
from bulkinfer.jobs.workers import Throughput

KV_BLOCK_TOKENS = 16
DEFAULT_MAX_ROWS = 100_000


def estimate_job(store: ObjectStore, key: str, spec: JobSpec, plan: Sequence[ShardPlan],
                 tokenizer: PublishedTokenizer | None, measured: list[Throughput], live_workers: int,
                 max_rows: int = DEFAULT_MAX_ROWS, registry: ModelRegistry | None = None,
                 output_lengths: OutputLengths | None = None) -> JobEstimate:
    """`registry`: the adapters rows may name (a row naming another one is counted failing, as the
    worker fails it); without it every row's adapter is taken as registered. `output_lengths`: the
    model's expected output length and the deployment's cap (default: the settings' defaults)."""
    counts = _Counts(tokenizer, spec.model, registry, output_lengths or OutputLengths())
    for shard in plan:
        if counts.read >= max_rows:
            break
        # Only the rows it counts are read: a shard past max_rows is never held whole.
        counts.add_shard(list(islice(read_shard_rows(store, key, spec, shard), max_rows - counts.read)))
    planned = sum(shard.estimated_rows for shard in plan)
    total = counts.read if counts.read < max_rows else max(planned, counts.read)
    scale = total / counts.read if counts.read else 0.0
    prompt = counts.scaled(counts.prompt, scale)
    shared = counts.scaled(counts.shared, scale)
    output = round(counts.output * scale)
    expected = round(counts.expected * scale)
    seconds, basis = _run_time(prompt, shared, expected, measured, live_workers, spec.model)
    return JobEstimate(
        model=spec.model, shards=len(plan), rows=total, rows_read=counts.read,
        rows_failing=round(counts.failing * scale), rows_deduplicated=round(counts.duplicates * scale),
        prompt_tokens=prompt, shared_prefix_tokens=shared, max_output_tokens=output,
        expected_output_tokens=expected,
        rows_by_lora={name: round(rows * scale) for name, rows in sorted(counts.by_lora.items())},
        estimated_seconds=seconds, estimate_basis=basis, tokenizer=None if tokenizer is None else
        f"{spec.model}'s own, published by worker {tokenizer.published_by} at {tokenizer.published_at}")


class _Counts:
    def __init__(self, tokenizer: PublishedTokenizer | None, model: str = "",
                 registry: ModelRegistry | None = None, lengths: OutputLengths | None = None) -> None:
        self.tokenizer = tokenizer
        self.model = model
        self.registry = registry
        self.lengths = lengths or OutputLengths()
        self.read = self.failing = self.duplicates = self.output = self.expected = 0
        self.prompt = self.shared = 0
        self.seen: set[str] = set()
        self.by_lora: dict[str, int] = {}  # running rows per LoRA adapter

    def _adapter(self, row: Row) -> tuple[bool, str | None]:
        """(whether the row's adapter is one it may run on, that adapter; None: the base)."""
        if self.registry is None:  # an OpenAI line's model of OpenAI's runs on the base
            return True, row.lora if row.lora_required else None
        try:
            return True, self.registry.row_adapter(self.model, row.lora, row.lora_required)
        except UnknownAdapter:
            return False, None

    def add_shard(self, items: list[Row | RowError]) -> None:
        self.read += len(items)
        seen = self.seen  # job-wide, as the planner marks copies across shards (jobs/planning/job_dedup.py)
        # The prefix cache never hits across adapters: prompts share prefixes within one adapter's rows.
        prompts: dict[str | None, list[list[int]]] = {}
        for item in items:
            if isinstance(item, RowError):
                self.failing += 1
                continue
            runnable, adapter = self._adapter(item)
            tokens = self._tokens(item)
            if not runnable or (tokens is None and self.tokenizer is not None):
                self.failing += 1
                continue
            key = row_key(dataclasses.replace(item, lora=adapter))  # as the worker merges rows (job_dedup)
            if key is not None:
                if key in seen:
                    self.duplicates += 1
                    continue
                seen.add(key)
            if item.embed is not None:  # no output tokens, and no prefix cache: every token computed
                self.prompt += len(tokens or ())
                continue
            self.output += self.lengths.most_per_row(item.sampling)
            self.expected += self.lengths.expected_per_row(item.sampling)
            if adapter is not None:
                self.by_lora[adapter] = self.by_lora.get(adapter, 0) + 1
            if tokens is not None:
                prompts.setdefault(adapter, []).append(tokens)
        for group in prompts.values():
            self.prompt += sum(map(len, group))
            self.shared += _shared_prefix_tokens(group)

    def _tokens(self, row: Row) -> list[int] | None:
        if self.tokenizer is None:
            return None
        try:
            if row.embed is not None:  # each input: text with the model's special tokens, or its ids
                encode = self.tokenizer.completion_tokens
                return [token for value in row.embed.inputs
                        for token in (list(value) if isinstance(value, tuple) else encode(value))]
            # Tools and template switches render as the worker renders them for a template that reads
            # them (a deployment's tool format for one that does not is the worker's: not counted).
            tools = row.tools.openai_tools() if row.tools is not None else None
            if row.messages is not None:
                return self.tokenizer.chat_tokens(row.messages, tools, row.template_kwargs)
            # A plain row runs as chat where the worker renders it so (PromptRenderer._messages).
            if row.as_chat is not None and (row.chat_required or self.tokenizer.has_own_template):
                return self.tokenizer.chat_tokens(row.as_chat, tools, row.template_kwargs)
            return self.tokenizer.completion_tokens(row.prompt or "")
        except Exception:  # noqa: BLE001 - a chat template or the tokenizer failed on this row: it fails there too
            return None

    def scaled(self, value: int, scale: float) -> int | None:
        return None if self.tokenizer is None else round(value * scale)


def _shared_prefix_tokens(prompts: list[list[int]]) -> int:
    """Tokens of each prompt that an earlier one (in sorted order, as the worker submits them)
    already computed, in whole KV blocks: what the prefix cache reuses."""
    ordered = sorted(prompts)
    shared = 0
    for previous, current in zip(ordered, ordered[1:], strict=False):
        common = 0
        for a, b in zip(previous, current, strict=False):
            if a != b:
                break
            common += 1
        common = min(common, len(current) - 1)  # the last prompt token is always computed
        shared += (common // KV_BLOCK_TOKENS) * KV_BLOCK_TOKENS
    return shared


def _run_time(prompt: int | None, shared: int | None, output: int, measured: list[Throughput],
              live_workers: int, model: str) -> tuple[float | None, str]:
    if prompt is None:
        return None, (f"unknown: no worker has loaded {model} yet, so its tokenizer is not published "
                      "and the prompt tokens are not counted")
    if not measured:
        return None, f"unknown: no worker of this deployment has measured {model}'s throughput yet"
    rate = sum(m.tokens_per_busy_s for m in measured) / len(measured)
    workers = max(1, live_workers)
    to_compute = prompt - (shared or 0) + output
    seconds = to_compute / (rate * workers)
    where = ", ".join(sorted({f"{m.hostname} ({m.dtype or '?'} on {m.device or '?'})" for m in measured}))
    live = f"{live_workers} live worker(s)" if live_workers else "1 worker (none is live now)"
    return round(seconds, 1), (f"{to_compute:,} tokens to compute (prompt tokens outside shared prefixes "
                               f"+ expected output tokens) at {rate:,.0f} tokens per engine-busy second, "
                               f"as measured by {where}, on {live}")
