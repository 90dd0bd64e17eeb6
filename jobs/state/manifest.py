"""The manifest: written last, it says what the job produced (counts, usage, parts, checksums).

Built only from shard results, sorted by shard, with no clock read of its own, so a finalize
that runs twice builds the same bytes and the second write is accepted as identical.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime

from pydantic import BaseModel, ConfigDict

from bulkinfer.jobs.layout import JobLayout
from bulkinfer.jobs.object_store.base import ObjectStore
from bulkinfer.jobs.state.results import (
    PartFile,
    ShardResult,
    SpeculationUsage,
    TokenUsage,
    add_usage_by_name,
)
from bulkinfer.jobs.state.status import RowCounts


class IncompleteJob(ValueError):
    """Shard results are missing or inconsistent: the manifest cannot be built yet."""


class ManifestPart(BaseModel):
    model_config = ConfigDict(frozen=True)

    shard_index: int
    first_row: int  # the position of this part's first row among all output rows
    rows_succeeded: int
    rows_failed: int
    usage: TokenUsage
    output: PartFile
    errors: PartFile
    dtype: str | None = None  # the engine's compute dtype for this part
    quantization: str | None = None  # the model's quantization scheme (None: unquantized weights)
    prompt_formats: list[str] = []  # how its rows' prompts were rendered (ShardResult.prompt_formats)


class Timings(BaseModel):
    model_config = ConfigDict(frozen=True)

    first_shard_started_at: datetime | None
    last_shard_finished_at: datetime | None
    shard_seconds: float  # summed over shards: the work, whatever the parallelism


class Manifest(BaseModel):
    model_config = ConfigDict(frozen=True)

    job_id: str
    spec_hash: str
    output_format: str
    rows: RowCounts
    usage: TokenUsage
    parts: list[ManifestPart]
    timings: Timings
    # The dtypes the engines computed in (one, unless workers on different hardware chose differently).
    dtypes: list[str] = []
    # The quantization schemes of the weights the engines ran (empty: unquantized), e.g.
    # "compressed-tensors W4A16 int4 (pack-quantized: group 128 weights)".
    quantizations: list[str] = []
    # How the rows' prompts were rendered: chat_template (the model's own), chatml (the fallback for a
    # model without one) or raw (completion prompts as they are); a job of plain rows on an instruct
    # model says chat_template unless it asked apply_chat_template false.
    prompt_formats: list[str] = []
    # Speculative decoding over the job (None when no shard verified drafts).
    speculation: SpeculationUsage | None = None
    # The part of `usage` each LoRA adapter ran, by name (empty: every row ran on the base model).
    usage_by_lora: dict[str, TokenUsage] = {}

    def to_bytes(self) -> bytes:
        """Canonical JSON: sorted keys, so equal manifests are equal bytes."""
        data = self.model_dump(mode="json")
        if not data["usage_by_lora"]:  # a job without adapters: the same bytes as before they existed
            del data["usage_by_lora"]
        if not data["quantizations"]:  # unquantized weights: likewise
            del data["quantizations"]
            for part in data["parts"]:
                del part["quantization"]
        return json.dumps(data, sort_keys=True, indent=1, ensure_ascii=False).encode() + b"\n"


def build_manifest(job_id: str, spec_hash: str, output_format: str, shard_count: int,
                   results: Sequence[ShardResult]) -> Manifest:
    """Raises `IncompleteJob` unless there is exactly one result for each of the `shard_count` shards."""
    by_index: dict[int, ShardResult] = {}
    for result in results:
        if result.shard_index in by_index and by_index[result.shard_index] != result:
            raise IncompleteJob(f"shard {result.shard_index} has two different results")
        by_index[result.shard_index] = result
    missing = sorted(set(range(shard_count)) - set(by_index))
    unexpected = sorted(set(by_index) - set(range(shard_count)))
    if missing or unexpected:
        raise IncompleteJob(f"shard results missing: {missing[:10]}, unexpected: {unexpected[:10]}")
    return manifest_of(job_id, spec_hash, output_format, [by_index[index] for index in range(shard_count)])


def partial_manifest(job_id: str, spec_hash: str, output_format: str,
                     results: Sequence[ShardResult]) -> Manifest:
    """The finished shards of an unfinished job, in shard order (a result per shard at most): what
    `GET /jobs/{id}/results?partial=true` answers. `first_row` counts the rows of these parts only."""
    by_index = {result.shard_index: result for result in results}
    return manifest_of(job_id, spec_hash, output_format, [by_index[index] for index in sorted(by_index)])


def manifest_of(job_id: str, spec_hash: str, output_format: str, ordered: Sequence[ShardResult]) -> Manifest:
    """A manifest over these shard results, in this order."""
    parts, first_row = [], 0
    for result in ordered:
        parts.append(ManifestPart(shard_index=result.shard_index, first_row=first_row,
                                  rows_succeeded=result.rows_succeeded, rows_failed=result.rows_failed,
                                  usage=result.usage, output=result.output, errors=result.errors,
                                  dtype=result.dtype, prompt_formats=result.prompt_formats,
                                  quantization=result.quantization))
        first_row += result.rows
    return Manifest(
        job_id=job_id, spec_hash=spec_hash, output_format=output_format,
        rows=RowCounts(total=first_row, succeeded=sum(r.rows_succeeded for r in ordered),
                       failed=sum(r.rows_failed for r in ordered),
                       deduplicated=sum(r.rows_deduplicated for r in ordered)),
        usage=sum((result.usage for result in ordered), TokenUsage()),
        usage_by_lora=add_usage_by_name([result.usage_by_lora for result in ordered]),
        parts=parts,
        dtypes=sorted({result.dtype for result in ordered if result.dtype}),
        quantizations=sorted({result.quantization for result in ordered if result.quantization}),
        prompt_formats=sorted({name for result in ordered for name in result.prompt_formats}),
        speculation=SpeculationUsage.of(
            [r.speculation.drafted_per_position for r in ordered if r.speculation],
            [r.speculation.accepted_per_position for r in ordered if r.speculation]),
        timings=Timings(
            first_shard_started_at=min((r.started_at for r in ordered), default=None),
            last_shard_finished_at=max((r.finished_at for r in ordered), default=None),
            shard_seconds=round(sum((r.finished_at - r.started_at).total_seconds() for r in ordered), 6)),
    )


def write_manifest(store: ObjectStore, layout: JobLayout, manifest: Manifest) -> bool:
    """Write once; True if this call wrote it, False if an identical manifest was there.

    Raises `AlreadyExists` if a different manifest was written before.
    """
    return store.put_once_or_same(layout.manifest_key, manifest.to_bytes())


def read_manifest(store: ObjectStore, layout: JobLayout) -> Manifest:
    return Manifest.model_validate_json(store.get_bytes(layout.manifest_key))
