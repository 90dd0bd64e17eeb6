"""What a finished shard reports: row counts, token usage, and the parts it wrote."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field

from jobs.layout import JobLayout
from jobs.object_store.base import AlreadyExists, ObjectStore


class TokenUsage(BaseModel):
    model_config = ConfigDict(frozen=True)

    prompt: int = Field(0, ge=0)
    cached: int = Field(0, ge=0, description="prompt tokens served from the prefix cache")
    completion: int = Field(0, ge=0)

    def __add__(self, other: TokenUsage) -> TokenUsage:
        return TokenUsage(prompt=self.prompt + other.prompt, cached=self.cached + other.cached,
                          completion=self.completion + other.completion)


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

    @property
    def rows(self) -> int:
        return self.rows_succeeded + self.rows_failed


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


def load_shard_results(store: ObjectStore, layout: JobLayout) -> list[ShardResult]:
    """Every shard result written so far, by shard index."""
    results = [ShardResult.model_validate_json(store.get_bytes(info.key))
               for info in store.list(layout.shard_results_dir + "/")]
    return sorted(results, key=lambda result: result.shard_index)
