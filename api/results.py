"""A finished job's output: its parts with presigned URLs, or every row streamed as JSON lines."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import closing

from bulkinfer.api.dependencies import ApiContext
from bulkinfer.api.errors import HttpError
from bulkinfer.api.schemas import JobResults, ResultPart
from bulkinfer.jobs.formats.csv_parts import part_rows
from bulkinfer.jobs.formats.jsonl_writer import dumps_line
from bulkinfer.jobs.object_store.base import ObjectNotFound, ObjectStore
from bulkinfer.jobs.object_store.factory import split_uri
from bulkinfer.jobs.spec import DELIMITED_FORMATS, InputFormat
from bulkinfer.jobs.state.manifest import Manifest, partial_manifest, read_manifest
from bulkinfer.jobs.state.results import PartFile, ShardResult, load_shard_results
from bulkinfer.jobs.state.status import COMPLETED_STATES, JobStatus

STREAM_CHUNK_BYTES = 1 << 20
PARQUET_BATCH_ROWS = 1024


def finished_manifest(context: ApiContext, status: JobStatus, partial: bool = False) -> Manifest:
    """The manifest of a job that succeeded (or expired: every row has an outcome, `expired` ones
    included); with `partial`, for a job in any other state, a manifest of the
    shards finished so far (their parts published). Otherwise 409 for an unfinished job."""
    job_id = status.job_id
    if status.state not in COMPLETED_STATES:
        if partial:
            return _finished_so_far(context, job_id)
        reason = f" ({status.error})" if status.error else ""
        raise HttpError(409, f"job {job_id} is {status.state.value}{reason}: results are ready once it "
                            "has succeeded; ask with partial=true for the parts finished so far")
    try:
        return read_manifest(context.store, context.repository.layout(job_id))
    except ObjectNotFound:
        raise HttpError(409, f"job {job_id} has succeeded but its manifest is missing") from None


def _finished_so_far(context: ApiContext, job_id: str) -> Manifest:
    """Shards whose result is committed and whose output and error parts are published at their
    final keys (a run that died between the two leaves the shard out until the reaper publishes)."""
    spec = context.repository.get_spec(job_id)  # the API stores it resolved: its formats are set
    results = [result for result in load_shard_results(context.store, context.repository.layout(job_id))
               if parts_published(context, result)]
    return partial_manifest(job_id, spec.spec_hash(), str(spec.effective_output_format or InputFormat.JSONL),
                            results)


def parts_published(context: ApiContext, result: ShardResult) -> bool:
    """Whether the result's output and error parts are at their final keys (not only staged)."""
    return all(_published(context, part) for part in (result.output, result.errors))


def _published(context: ApiContext, part: PartFile) -> bool:
    store, key = part_store(context, part.uri)
    return store.exists(key)


def part_store(context: ApiContext, uri: str) -> tuple[ObjectStore, str]:
    """Parts live in the job store, or under the spec's output_uri (another bucket or folder)."""
    scheme, bucket, key = split_uri(uri)
    if scheme == "s3":
        return context.s3_store(bucket), key
    from bulkinfer.jobs.object_store.local import LocalObjectStore

    return LocalObjectStore("/"), key


def _result_part(context: ApiContext, shard_index: int, first_row: int | None, part: PartFile) -> ResultPart:
    store, key = part_store(context, part.uri)
    return ResultPart(shard_index=shard_index, first_row=first_row, rows=part.rows, bytes=part.bytes,
                      sha256=part.sha256, uri=part.uri, url=store.presign_get(key))


def job_results(context: ApiContext, status: JobStatus, partial: bool = False) -> JobResults:
    manifest = finished_manifest(context, status, partial)
    return JobResults(
        job_id=status.job_id, state=status.state.value, partial=status.state not in COMPLETED_STATES,
        shards_done=len(manifest.parts), shards_total=status.shards.total or len(manifest.parts),
        output_format=manifest.output_format, rows=manifest.rows, usage=manifest.usage,
        parts=[_result_part(context, p.shard_index, p.first_row, p.output) for p in manifest.parts],
        error_parts=[_result_part(context, p.shard_index, None, p.errors) for p in manifest.parts],
        dtypes=manifest.dtypes, usage_by_lora=manifest.usage_by_lora)


def stream_rows(context: ApiContext, manifest: Manifest) -> Iterator[bytes]:
    """Every output row in order as JSON lines: JSONL parts pass through byte for byte, Parquet,
    CSV and TSV parts are converted a batch at a time.
    """
    for part in manifest.parts:
        store, key = part_store(context, part.output.uri)
        if manifest.output_format == InputFormat.PARQUET:
            yield from _parquet_as_json_lines(store, key)
            continue
        if manifest.output_format in DELIMITED_FORMATS:
            with closing(store.open_read(key)) as stream:
                for rows in part_rows(stream, manifest.output_format):
                    yield b"".join(dumps_line(row) for row in rows)
            continue
        with store.open_read(key) as stream:
            while chunk := stream.read(STREAM_CHUNK_BYTES):
                yield chunk


def _parquet_as_json_lines(store: ObjectStore, key: str) -> Iterator[bytes]:
    import pyarrow.parquet as pq

    with store.open_seekable(key) as file:
        parquet = pq.ParquetFile(file)
        for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, use_threads=False):
            yield b"".join(dumps_line(record) for record in batch.to_pylist())
