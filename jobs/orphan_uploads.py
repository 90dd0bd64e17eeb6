"""Uploads that never became a job: the API stopped (killed, crashed) after it had streamed an input
into `jobs/<id>/input/` but before it wrote that job's `job.json`.

Such a folder holds a finished input object, or an unfinished write (an S3 multipart upload, a local
temp file), and no job will ever read it. The reaper calls `sweep_orphan_uploads` now and then;
it removes finished inputs of folders without `job.json` once they are an hour old (a submit writes
`job.json` seconds after its upload ends), and unfinished writes under such folders once they are
six hours old (an upload still streaming is left alone). Inputs of real jobs are never touched.

The same goes for /v1 files (`files/<owner>/<file_id>/`): an upload writes its content, then its
record (`meta.json`); content with no record an hour on, and unfinished writes there six hours on,
are what an API stopped mid-upload left, and are removed. A file with its record is never touched.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from bulkinfer.jobs.layout import FILE_CONTENT_NAME, FILE_RECORD_NAME, area_root, jobs_root
from bulkinfer.jobs.object_store.base import ObjectStore

FINISHED_GRACE_S = 3600.0
UNFINISHED_GRACE_S = 6 * 3600.0


@dataclass
class SweepResult:
    inputs_removed: int = 0
    writes_aborted: int = 0
    files_removed: int = 0  # /v1 file contents whose upload never wrote a record
    file_writes_aborted: int = 0


def sweep_orphan_uploads(store: ObjectStore, prefix: str = "", *, now: float | None = None,
                         finished_grace_s: float = FINISHED_GRACE_S,
                         unfinished_grace_s: float = UNFINISHED_GRACE_S) -> SweepResult:
    now = time.time() if now is None else now
    jobs_dir = jobs_root(prefix)
    with_spec: set[str] = set()
    inputs: list[tuple[str, str, float | None]] = []  # (job id, key, modified)
    for info in store.list(jobs_dir):
        job_id, _, rest = info.key[len(jobs_dir):].partition("/")
        if rest == "job.json":
            with_spec.add(job_id)
        elif rest.startswith("input/"):
            inputs.append((job_id, info.key, info.modified))
    result = SweepResult()
    for job_id, key, modified in inputs:
        if job_id not in with_spec and modified is not None and now - modified >= finished_grace_s:
            store.delete(key)
            result.inputs_removed += 1
    for write in store.unfinished_writes(jobs_dir):
        job_id, _, rest = write.key[len(jobs_dir):].partition("/")
        old_enough = now - write.started >= unfinished_grace_s
        if rest.startswith("input/") and job_id not in with_spec and old_enough:
            store.abort_write(write)
            result.writes_aborted += 1
    _sweep_files(store, prefix, now, finished_grace_s, unfinished_grace_s, result)
    return result


def _sweep_files(store: ObjectStore, prefix: str, now: float, finished_grace_s: float,
                 unfinished_grace_s: float, result: SweepResult) -> None:
    files_dir = area_root("files", prefix)
    with_record: set[str] = set()  # "<owner>/<file_id>"
    contents: list[tuple[str, str, float | None]] = []
    for info in store.list(files_dir):
        folder, _, name = info.key[len(files_dir):].rpartition("/")
        if name == FILE_RECORD_NAME:
            with_record.add(folder)
        elif name == FILE_CONTENT_NAME:
            contents.append((folder, info.key, info.modified))
    for folder, key, modified in contents:
        if folder not in with_record and modified is not None and now - modified >= finished_grace_s:
            store.delete(key)
            result.files_removed += 1
    for write in store.unfinished_writes(files_dir):
        folder = write.key[len(files_dir):].rpartition("/")[0]
        if folder not in with_record and now - write.started >= unfinished_grace_s:
            store.abort_write(write)
            result.file_writes_aborted += 1
