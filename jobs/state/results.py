"""What a finished shard reports: row counts, token usage, and the parts it wrote."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, computed_field

from bulkinfer.jobs.layout import JobLayout
from bulkinfer.jobs.object_store.base import AlreadyExists, ObjectNotFound, ObjectStore

if TYPE_CHECKING:
    from bulkinfer.jobs.formats.output import OutputRow
    from bulkinfer.jobs.planning.sharding import ShardPlan


class TokenUsage(BaseModel):
    model_config = ConfigDict(frozen=True)

    prompt: int = Field(0, ge=0)
    cached: int = Field(0, ge=0, description="prompt tokens served from the prefix cache")
    completion: int = Field(0, ge=0)
    engine_seconds: float = Field(0.0, ge=0, description="engine time attributed to these rows: each "
                                  "step's time split over the requests in it by the tokens they computed")

    def __add__(self, other: TokenUsage) -> TokenUsage:
        # Engine seconds in whole milliseconds, as the live counters add them: both give equal sums.
        return TokenUsage(prompt=self.prompt + other.prompt, cached=self.cached + other.cached,
                          completion=self.completion + other.completion,
                          engine_seconds=round(self.engine_seconds + other.engine_seconds, 3))


class SpeculationUsage(BaseModel):
    """Speculative decoding over some rows: drafts verified and accepted at each draft position.
    Every verification drafts a first token, so `drafted_per_position[0]` counts verifications."""

    model_config = ConfigDict(frozen=True)

    drafted_per_position: list[int] = Field(default_factory=list)
    accepted_per_position: list[int] = Field(default_factory=list)

    @classmethod
    def of(cls, drafted: Sequence[Sequence[int]],
           accepted: Sequence[Sequence[int]]) -> SpeculationUsage | None:
        """The sum of per-row counts; None when no row verified a draft."""
        usage = cls(drafted_per_position=_add_positions(drafted),
                    accepted_per_position=_add_positions(accepted))
        return usage if usage.drafted_per_position else None

    @computed_field  # type: ignore[prop-decorator]
    @property
    def draft_tokens(self) -> int:
        return sum(self.drafted_per_position)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def accepted_tokens(self) -> int:
        return sum(self.accepted_per_position)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def acceptance_rate(self) -> float:
        return round(self.accepted_tokens / self.draft_tokens, 4) if self.draft_tokens else 0.0

    @computed_field  # type: ignore[prop-decorator]
    @property
    def acceptance_rate_per_position(self) -> list[float]:
        accepted = self.accepted_per_position
        return [round((accepted[i] if i < len(accepted) else 0) / d, 4) if d else 0.0
                for i, d in enumerate(self.drafted_per_position)]

    @computed_field  # type: ignore[prop-decorator]
    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verification: the accepted drafts and the one the target adds."""
        verifications = self.drafted_per_position[0] if self.drafted_per_position else 0
        return round(1 + self.accepted_tokens / verifications, 4) if verifications else 0.0


def _add_positions(lists: Sequence[Sequence[int]]) -> list[int]:
    total: list[int] = []
    for counts in lists:
        total.extend([0] * (len(counts) - len(total)))
        for i, count in enumerate(counts):
            total[i] += count
    return total


class PartFile(BaseModel):
    """An object a shard wrote, with what a reader needs to trust it."""

    model_config = ConfigDict(frozen=True)

    key: str
    uri: str
    rows: int
    bytes: int
    sha256: str


class ShardResult(BaseModel):
    """Written once to `shards/part-NNNNN.json` after the shard's parts: its presence means the
    shard is done. Counters, the manifest and a lost Redis are all rebuilt from these.
    """

    model_config = ConfigDict(frozen=True)

    shard_index: int
    planned_rows: int = Field(description="the plan's estimate, to correct the job's total")
    rows_succeeded: int
    rows_failed: int
    usage: TokenUsage
    output: PartFile
    errors: PartFile
    started_at: datetime
    finished_at: datetime
    dtype: str | None = Field(None, description="the dtype the engine computed this shard in")
    quantization: str | None = Field(None, description="the model checkpoint's quantization scheme "
                                     "(None: unquantized weights)")
    rows_deduplicated: int = Field(0, description="rows that took an identical deterministic row's output "
                                   "instead of running")
    error_codes: dict[str, int] = Field(default_factory=dict,
                                        description="the failed rows by error code (row_too_long: 3, ...)")
    speculation: SpeculationUsage | None = Field(None, description="speculative decoding's drafts and "
                                                 "acceptance over the shard's rows (None: no drafts)")
    usage_by_lora: dict[str, TokenUsage] = Field(default_factory=dict, description="the part of `usage` "
                                                 "each LoRA adapter ran (by name; the base's is the rest)")
    prompt_formats: list[str] = Field(default_factory=list, description="how its rows' prompts were "
                                      "rendered: chat_template (the model's), chatml (the fallback for a "
                                      "model without one) or raw (completion prompts as they are)")
    fence: str | None = Field(None, description="the writing run's fencing token: its parts were staged "
                              "under it and are published from there (jobs/state/part_publication.py); "
                              "None: written in place")

    @property
    def rows(self) -> int:
        return self.rows_succeeded + self.rows_failed

    @classmethod
    def from_outputs(cls, shard: ShardPlan, outputs: Sequence[OutputRow], *, output: PartFile,
                     errors: PartFile, started_at: datetime, finished_at: datetime,
                     dtype: str | None = None, fence: str | None = None,
                     quantization: str | None = None) -> ShardResult:
        """The result of a shard whose `outputs` were written as `output` and `errors`."""
        failed = sum(row.failed for row in outputs)
        codes = Counter(row.error_code for row in outputs if row.error_code is not None)
        # What the engine computed: a deduplicated copy's tokens were computed once, for its source.
        computed = [row for row in outputs if not row.deduplicated]
        usage = rows_usage(computed)
        adapters = sorted({row.lora for row in computed if row.lora is not None})
        by_lora = {name: rows_usage([row for row in computed if row.lora == name]) for name in adapters}
        return cls(shard_index=shard.index, planned_rows=shard.estimated_rows,
                   rows_succeeded=len(outputs) - failed, rows_failed=failed, usage=usage, output=output,
                   errors=errors, started_at=started_at, finished_at=finished_at, dtype=dtype,
                   quantization=quantization,
                   rows_deduplicated=sum(row.deduplicated for row in outputs),
                   error_codes=dict(sorted(codes.items())), fence=fence, usage_by_lora=by_lora,
                   prompt_formats=sorted({row.prompt_format for row in outputs if row.prompt_format}),
                   speculation=SpeculationUsage.of([row.drafted_per_position for row in computed],
                                                   [row.accepted_per_position for row in computed]))


def rows_usage(rows: Sequence[OutputRow]) -> TokenUsage:
    """The tokens and engine time of rows the engine computed."""
    return TokenUsage(prompt=sum(row.prompt_tokens or 0 for row in rows),
                      cached=sum(row.cached_tokens or 0 for row in rows),
                      completion=sum(row.completion_tokens or 0 for row in rows),
                      engine_seconds=round(sum(row.engine_seconds for row in rows), 3))


def add_usage_by_name(parts: Sequence[dict[str, TokenUsage]]) -> dict[str, TokenUsage]:
    """Per-name usages summed over parts (shards), names sorted."""
    total: dict[str, TokenUsage] = {}
    for part in parts:
        for name, usage in part.items():
            total[name] = total.get(name, TokenUsage()) + usage
    return dict(sorted(total.items()))


def save_shard_result(store: ObjectStore, layout: JobLayout, result: ShardResult) -> ShardResult:
    """Write the result once; if an earlier run of the shard already wrote one, that one stands
    and is returned (so a shard delivered twice is counted from one result).
    """
    key = layout.shard_result_key(result.shard_index)
    try:
        store.put_bytes(key, result.model_dump_json().encode(), if_none_match=True)
    except AlreadyExists:
        return ShardResult.model_validate_json(store.get_bytes(key))
    return result


def committed_shard_result(store: ObjectStore, layout: JobLayout, shard_index: int) -> ShardResult | None:
    """The shard's write-once result, or None while no run has committed one."""
    try:
        return ShardResult.model_validate_json(store.get_bytes(layout.shard_result_key(shard_index)))
    except ObjectNotFound:
        return None


def load_shard_results(store: ObjectStore, layout: JobLayout) -> list[ShardResult]:
    """Every shard result written so far, by shard index."""
    results = [ShardResult.model_validate_json(store.get_bytes(info.key))
               for info in store.list(layout.shard_results_dir + "/")]
    return sorted(results, key=lambda result: result.shard_index)
