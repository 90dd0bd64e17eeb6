"""The output of `bulkinfer run`, written so that an interrupted run resumes without losing or
repeating a row.

Rows are written batch by batch, in input order. Beside OUT, a hidden work directory
(`.OUT.bulkinfer-run/`) holds `progress.json`: what the run is (a fingerprint of the spec and the
input), how many input rows are done, and what of OUT holds them. It is replaced atomically after
each batch is durable, so it never claims more than is written:

- JSONL / OpenAI batch / CSV / TSV: each batch is appended to OUT (a CSV's header row with the
  first) and fsynced; `progress.json` then records OUT's length. On resume OUT is cut back to that
  length (a batch written after the last record, or a torn line from a kill, goes) and rows after
  `rows_done` run again.
- Parquet: each batch is one part file in the work directory (written to a temp name, renamed);
  `progress.json` lists the parts. On resume parts it does not list are deleted. At the end the
  parts are combined into OUT (temp file, rename).

When OUT is complete the parts go and `progress.json` stays, marked finished with OUT's size and
mtime: rerunning the same command is then a no-op that succeeds (`AlreadyComplete`), as make or a
cron retry expects. OUT changed since, OUT without a work directory, or another run's output is
left alone unless told to overwrite it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bulkinfer.jobs.formats.output import OutputRow
from bulkinfer.jobs.formats.parts import write_output_part
from bulkinfer.jobs.object_store.local import LocalObjectStore
from bulkinfer.jobs.spec import DELIMITED_FORMATS, InputFormat, JobSpec

PROGRESS_FILE = "progress.json"


class OutputConflict(RuntimeError):
    """OUT holds something this run must not touch (a finished output, another run's rows)."""


class AlreadyComplete(Exception):
    """OUT is the finished output of this same run (spec and input): nothing to do."""

    def __init__(self, progress: Progress) -> None:
        super().__init__(f"{progress.rows_done} rows already done")
        self.progress = progress


@dataclass
class Progress:
    fingerprint: str  # the spec and the input this output belongs to
    created: int  # unix seconds stamped in OpenAI batch bodies: the same on every resume
    rows_done: int = 0
    rows_failed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    output_bytes: int = 0  # JSONL / OpenAI batch: OUT's durable length
    parts: list[str] = field(default_factory=list)  # Parquet: part files, in order
    finished: bool = False  # OUT is complete; then OUT's size and mtime as the run left it
    output_size: int = 0
    output_mtime_ns: int = 0

    def add(self, rows: Sequence[OutputRow]) -> None:
        self.rows_done += len(rows)
        self.rows_failed += sum(row.failed for row in rows)
        self.prompt_tokens += sum(row.prompt_tokens or 0 for row in rows)
        self.cached_tokens += sum(row.cached_tokens or 0 for row in rows)
        self.completion_tokens += sum(row.completion_tokens or 0 for row in rows)


def work_dir_for(output: Path) -> Path:
    return output.parent / f".{output.name}.bulkinfer-run"


def _fsync_dir(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _atomic_write(path: Path, data: bytes) -> None:
    descriptor, temp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    try:
        with os.fdopen(descriptor, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, path)
    finally:
        Path(temp).unlink(missing_ok=True)
    _fsync_dir(path.parent)


class ResumableOutput:
    """Open with `open_output`; `append(rows)` makes a batch durable; `finish()` completes OUT."""

    def __init__(self, output: Path, spec: JobSpec, progress: Progress, *, job_id: str) -> None:
        self.output = output
        self.spec = spec
        self.progress = progress
        self.job_id = job_id
        self.work_dir = work_dir_for(output)
        self._store = LocalObjectStore(self.work_dir)
        self.is_parquet = spec.effective_output_format == InputFormat.PARQUET
        self.embedding_dimension: int | None = None  # an embed run's vector size, once the model says

    # -- opening ----------------------------------------------------------------------------

    def _recover(self) -> None:
        """Drop whatever a killed run wrote after its last progress record."""
        if self.is_parquet:
            listed = set(self.progress.parts)
            for path in (self.work_dir / "parts").glob("*"):
                if path.name not in listed:
                    path.unlink()
            return
        self.output.touch()
        if self.output.stat().st_size != self.progress.output_bytes:
            with open(self.output, "r+b") as file:
                file.truncate(self.progress.output_bytes)
                os.fsync(file.fileno())

    def _save(self) -> None:
        _atomic_write(self.work_dir / PROGRESS_FILE, json.dumps(asdict(self.progress), indent=1).encode())

    # -- writing ----------------------------------------------------------------------------

    def append(self, rows: Sequence[OutputRow]) -> None:
        """Write one batch durably, then record it (a kill in between only costs the batch)."""
        if not rows:
            return
        key = f"parts/part-{len(self.progress.parts):06d}.parquet" if self.is_parquet else "batch.tmp"
        write_output_part(self._store, key, rows, self.spec, job_id=self.job_id,
                          created=self.progress.created, if_none_match=False,
                          embedding_dimension=self.embedding_dimension,
                          csv_header=self.progress.output_bytes == 0)  # CSV: one header, at the top
        if self.is_parquet:
            with open(self.work_dir / key, "rb") as part:  # durable before progress.json lists it
                os.fsync(part.fileno())
            self.progress.parts.append(key.removeprefix("parts/"))
        else:
            data = (self.work_dir / key).read_bytes()
            with open(self.output, "ab") as file:
                file.write(data)
                file.flush()
                os.fsync(file.fileno())
            self.progress.output_bytes += len(data)
        self.progress.add(rows)
        self._save()

    def finish(self) -> None:
        """Complete OUT (Parquet: combine the parts), drop the parts, and record OUT as finished."""
        if self.is_parquet:
            combine_parquet([self.work_dir / "parts" / name for name in self.progress.parts], self.output,
                            self.spec)
        elif self.progress.output_bytes == 0 and self.spec.effective_output_format in DELIMITED_FORMATS:
            # No row at all: a CSV still names its columns.
            write_output_part(LocalObjectStore(self.output.parent), self.output.name, [], self.spec,
                              job_id=self.job_id, if_none_match=False,
                              embedding_dimension=self.embedding_dimension)
        shutil.rmtree(self.work_dir / "parts", ignore_errors=True)
        stat = self.output.stat()
        self.progress.finished = True
        self.progress.output_size, self.progress.output_mtime_ns = stat.st_size, stat.st_mtime_ns
        self._save()


def open_output(output: Path, spec: JobSpec, fingerprint: str, *, job_id: str, created: int,
                overwrite: bool = False) -> ResumableOutput:
    """The output to write, resumed where a run of the same spec and input stopped.

    Raises `OutputConflict` for a finished OUT or a partial one of another spec or input (unless
    `overwrite`, which starts over).
    """
    work_dir = work_dir_for(output)
    if overwrite:
        shutil.rmtree(work_dir, ignore_errors=True)
        output.unlink(missing_ok=True)
    progress_file = work_dir / PROGRESS_FILE
    if progress_file.is_file():
        progress = Progress(**json.loads(progress_file.read_text()))
        if progress.fingerprint != fingerprint:
            raise OutputConflict(f"{output} is the output of another run (different options or input); "
                                 "pass --overwrite to start over")
        if progress.finished:
            stat = output.stat() if output.exists() else None
            if stat is not None and (stat.st_size, stat.st_mtime_ns) == (progress.output_size,
                                                                          progress.output_mtime_ns):
                raise AlreadyComplete(progress)
            raise OutputConflict(f"{output} changed or went away since this run finished; "
                                 "pass --overwrite to run it again")
    elif output.exists():
        raise OutputConflict(f"{output} already exists (a finished run, or another file); "
                             "pass --overwrite to replace it")
    else:
        shutil.rmtree(work_dir, ignore_errors=True)  # a run killed before its first record
        (work_dir / "parts").mkdir(parents=True)
        progress = Progress(fingerprint=fingerprint, created=created)
    writer = ResumableOutput(output, spec, progress, job_id=job_id)
    writer._recover()
    writer._save()
    return writer


def combine_parquet(parts: Sequence[Path], output: Path, spec: JobSpec) -> None:
    """One Parquet file from the parts, in order, written to a temp name and renamed into place.

    A column all null in one batch (a passthrough column) takes the type the other parts give it.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    from bulkinfer.jobs.formats.embedding_writer import embedding_table
    from bulkinfer.jobs.formats.parts import generated_table

    schemas = [pq.read_schema(part) for part in parts]
    empty = embedding_table([], spec) if spec.is_embed else generated_table([], spec)
    schema = pa.unify_schemas(schemas, promote_options="permissive") if schemas else empty.schema
    descriptor, temp = tempfile.mkstemp(prefix=f".{output.name}.", dir=output.parent)
    os.close(descriptor)
    try:
        with pq.ParquetWriter(temp, schema) as writer:
            for part in parts:
                writer.write_table(pq.read_table(part).select(schema.names).cast(schema))
        os.replace(temp, output)
    finally:
        Path(temp).unlink(missing_ok=True)
    _fsync_dir(output.parent)
