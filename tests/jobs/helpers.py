"""Test helpers: a stand-in for the engine, and a shard run the way a worker will run it."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from bulkinfer.jobs.formats.output import OutputRow
from bulkinfer.jobs.formats.parts import write_error_part, write_output_part
from bulkinfer.jobs.formats.readers import read_shard_rows
from bulkinfer.jobs.formats.rows import Row, RowError
from bulkinfer.jobs.layout import JobLayout, output_location
from bulkinfer.jobs.object_store.base import ObjectStore
from bulkinfer.jobs.planning.sharding import ShardPlan
from bulkinfer.jobs.spec import JobSpec
from bulkinfer.jobs.state.results import ShardResult, save_shard_result

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def echo_output(row: Row) -> OutputRow:
    """What a fake engine answers: the prompt (or last message) reversed, with token counts from
    its length; a row that asked for JSON gets a JSON object back.
    """
    source = row.prompt if row.prompt is not None else str(row.messages[-1]["content"])
    text = source[::-1]
    if row.response_format is not None:
        text = '{"echo": ' + f'"{len(source)}"' + "}"
    return OutputRow.completed(row, text, "stop", prompt_tokens=len(source), cached_tokens=len(source) // 2,
                               completion_tokens=len(text))


def run_shard(input_store: ObjectStore, input_key: str, job_store: ObjectStore, layout: JobLayout,
              spec: JobSpec, shard: ShardPlan) -> ShardResult:
    """Read, "infer", write the parts and the result: the worker's sequence, without an engine."""
    outputs = [OutputRow.from_error(item) if isinstance(item, RowError) else echo_output(item)
               for item in read_shard_rows(input_store, input_key, spec, shard)]
    location = output_location(spec, job_store, layout)
    output = write_output_part(location.store, location.part_key(shard.index), outputs, spec,
                               job_id=layout.job_id, created=1_700_000_000)
    errors = write_error_part(job_store, layout.error_part_key(shard.index), outputs)
    result = ShardResult.from_outputs(shard, outputs, output=output, errors=errors,
                                      started_at=T0 + timedelta(seconds=shard.index),
                                      finished_at=T0 + timedelta(seconds=shard.index + 2))
    return save_shard_result(job_store, layout, result)
