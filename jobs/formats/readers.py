"""`read_shard_rows`: the one call a worker makes to get a shard's rows, whatever the format."""

from __future__ import annotations

from collections.abc import Iterator

from bulkinfer.jobs.formats.csv_input import iter_csv_rows
from bulkinfer.jobs.formats.jsonl import iter_jsonl_rows
from bulkinfer.jobs.formats.openai_batch import iter_openai_batch_rows
from bulkinfer.jobs.formats.parquet import iter_parquet_rows
from bulkinfer.jobs.formats.rows import Row, RowBuilder, RowError
from bulkinfer.jobs.image_limits import ImageLimits
from bulkinfer.jobs.object_store.base import ObjectStore
from bulkinfer.jobs.planning.sharding import ShardPlan
from bulkinfer.jobs.settings import process_settings
from bulkinfer.jobs.spec import DELIMITED_FORMATS, InputFormat, JobSpec


def read_shard_rows(store: ObjectStore, key: str, spec: JobSpec, shard: ShardPlan, *,
                    limits: ImageLimits | None = None) -> Iterator[Row | RowError]:
    """The shard's rows in input order; rows that cannot run come as `RowError`s in their place.
    A retry shard (`only_rows` set) yields only the rows it lists. `limits`: the bounds on a row's
    images (default: this process's `image_*` settings)."""
    limits = limits or process_settings().image_limits()
    rows = _all_shard_rows(store, key, spec, shard, limits)
    if shard.only_rows is None:
        return rows
    wanted = frozenset(shard.only_rows)
    return (row for row in rows if row.index in wanted)


def _all_shard_rows(store: ObjectStore, key: str, spec: JobSpec, shard: ShardPlan,
                    limits: ImageLimits) -> Iterator[Row | RowError]:
    if spec.input_format == InputFormat.PARQUET:
        return iter_parquet_rows(store, key, shard, RowBuilder(spec, limits=limits))
    if spec.input_format in DELIMITED_FORMATS:
        return iter_csv_rows(store, key, shard, RowBuilder(spec, limits=limits))
    if shard.byte_start is None or shard.byte_end is None:
        raise ValueError(f"shard {shard.shard_id} has no byte range; it was not planned for JSONL")
    if spec.input_format == InputFormat.OPENAI_BATCH:
        return iter_openai_batch_rows(store, key, shard.byte_start, shard.byte_end, spec,
                                      shard.repeated_custom_ids, limits=limits)
    if spec.input_format == InputFormat.JSONL:
        return iter_jsonl_rows(store, key, shard.byte_start, shard.byte_end, RowBuilder(spec, limits=limits))
    raise ValueError("read_shard_rows needs a resolved input_format (see formats.detect.resolve_spec)")
