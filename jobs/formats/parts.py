"""Writing a shard's output part and error part: rows in input order, sha256 and size measured
while streaming, write-once by default (a shard that runs twice cannot replace its first part).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from bulkinfer.jobs.formats.csv_dialect import DELIMITERS
from bulkinfer.jobs.formats.csv_writer import write_csv
from bulkinfer.jobs.formats.embedding_writer import embedding_table, jsonl_embedding_record
from bulkinfer.jobs.formats.jsonl_writer import dumps_line, error_record, jsonl_output_record
from bulkinfer.jobs.formats.openai_batch_writer import openai_batch_record
from bulkinfer.jobs.formats.output import OutputRow
from bulkinfer.jobs.formats.parquet_writer import (
    may_have_choices,
    may_have_logprobs,
    may_have_lora,
    may_have_prompt_logprobs,
    may_have_reasoning,
    may_have_tool_calls,
    output_table,
)
from bulkinfer.jobs.object_store.base import ObjectStore, ObjectWriter
from bulkinfer.jobs.spec import DELIMITED_FORMATS, InputFormat, JobSpec
from bulkinfer.jobs.state.results import PartFile

if TYPE_CHECKING:
    import pyarrow as pa


class _MeasuringWriter:
    """Passes bytes to the object writer, hashing and counting them on the way."""

    def __init__(self, writer: ObjectWriter) -> None:
        self._writer = writer
        self.sha256 = hashlib.sha256()
        self.size = 0
        self.closed = False

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        self.size += len(data)
        return self._writer.write(data)

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        pass

    def part_file(self, store: ObjectStore, key: str, rows: int) -> PartFile:
        digest = self.sha256.hexdigest()
        return PartFile(key=key, uri=store.uri(key), rows=rows, bytes=self.size, sha256=digest)


def includes_json_column(spec: JobSpec) -> bool:
    """Whether outputs get a parsed-JSON column: decided per job, so every part has the same columns."""
    return bool(spec.response_format or spec.response_format_column
                or spec.input_format == InputFormat.OPENAI_BATCH)


def write_output_part(store: ObjectStore, key: str, rows: Iterable[OutputRow], spec: JobSpec, *, job_id: str,
                      created: int | None = None, if_none_match: bool = True,
                      embedding_dimension: int | None = None, csv_header: bool = True) -> PartFile:
    """Every row of the shard, failed ones included, sorted into input order.

    `created` (unix seconds) stamps OpenAI response bodies; default: now. `embedding_dimension`: an
    embed job's vector size (the model's), so a Parquet part of failed rows only has the job's type.
    `csv_header`: a CSV or TSV part starts with the header row (`bulkinfer run` appends parts to
    one file and writes it once).
    """
    ordered = sorted(rows, key=lambda row: row.index)
    output_format = spec.effective_output_format
    with store.open_write(key, if_none_match=if_none_match) as writer:
        sink = _MeasuringWriter(writer)
        if output_format == InputFormat.PARQUET:
            import pyarrow.parquet as pq

            pq.write_table(_output_table(ordered, spec, embedding_dimension), sink)
        elif output_format in DELIMITED_FORMATS:
            write_csv(_output_table(ordered, spec, embedding_dimension), sink, DELIMITERS[output_format],
                      include_header=csv_header)
        elif output_format == InputFormat.OPENAI_BATCH:
            stamp = int(time.time()) if created is None else created
            for row in ordered:
                record = openai_batch_record(row, job_id=job_id, model=spec.model, created=stamp)
                sink.write(dumps_line(record))
        elif output_format == InputFormat.JSONL:
            include_json = includes_json_column(spec)
            for row in ordered:
                record = jsonl_embedding_record(row, spec) if spec.is_embed else jsonl_output_record(row,
                                                                                                   include_json)
                sink.write(dumps_line(record))
        else:
            raise ValueError("write_output_part needs a resolved output format")
    return sink.part_file(store, key, rows=len(ordered))


def _output_table(rows: list[OutputRow], spec: JobSpec, embedding_dimension: int | None) -> pa.Table:
    """The part's columns, as Parquet has them (a CSV part writes the same ones)."""
    if spec.is_embed:
        return embedding_table(rows, spec, embedding_dimension)
    return generated_table(rows, spec)


def generated_table(rows: list[OutputRow], spec: JobSpec) -> pa.Table:
    """A generate job's columns for `rows`: the same for every part of the job (its spec decides)."""
    return output_table(rows, includes_json_column(spec), spec.passthrough_columns,
                        include_logprobs=may_have_logprobs(spec), include_choices=may_have_choices(spec),
                        include_prompt_logprobs=may_have_prompt_logprobs(spec),
                        include_lora=may_have_lora(spec), include_tool_calls=may_have_tool_calls(spec),
                        include_reasoning=may_have_reasoning(spec))


def write_error_part(store: ObjectStore, key: str, rows: Iterable[OutputRow], *,
                     if_none_match: bool = True) -> PartFile:
    """The failed rows among `rows`, in input order (an empty part when none failed)."""
    failed = sorted((row for row in rows if row.failed), key=lambda row: row.index)
    with store.open_write(key, if_none_match=if_none_match) as writer:
        sink = _MeasuringWriter(writer)
        for row in failed:
            sink.write(dumps_line(error_record(row)))
    return sink.part_file(store, key, rows=len(failed))
