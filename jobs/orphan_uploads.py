"""Uploads that never became a job: the API stopped (killed, crashed) after it had streamed an input
into `jobs/<id>/input/` but before it wrote that job's `job.json`.

Such a folder holds a finished input object, or an unfinished write (an S3 multipart upload, a local
temp file), and no job will ever read it. The reaper calls `sweep_orphan_uploads` now and then;
it removes finished inputs of folders without `job.json` once they are an hour old (a submit writes
`job.json` seconds after its upload ends), and unfinished writes under such folders once they are
six hours old (an upload still streaming is left alone). Inputs of real jobs are never touched.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from jobs.layout import jobs_root
from jobs.object_store.base import ObjectStore

FINISHED_GRACE_S = 3600.0
UNFINISHED_GRACE_S = 6 * 3600.0


@dataclass
class SweepResult:
    inputs_removed: int = 0
    writes_aborted: int = 0


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
    return result
