"""`client.jobs` (sync) and `async_client.jobs` (async): create, get, list, cancel, retry, wait for
and read jobs."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, overload

from pydantic import BaseModel

from bulkinfer.api.client.errors import WaitTimeout
from bulkinfer.api.client.inputs import InputSource, Upload, is_uri, prepare_upload
from bulkinfer.api.client.merged import AsyncMergedResults, MergedResults
from bulkinfer.api.client.models import JobPage, JobResults, JobSpec, JobState, JobStatus
from bulkinfer.api.client.progress import JobProgress, wants_progress
from bulkinfer.api.client.results import AsyncResults, Results
from bulkinfer.api.client.transport import AsyncTransport, Transport
from bulkinfer.jobs.planning.estimate_report import JobEstimate

JobRef = str | JobStatus  # a job id, or a status the client returned
ProgressCallback = Callable[[JobStatus], None]


def job_id_of(job: JobRef) -> str:
    return job.job_id if isinstance(job, JobStatus) else str(job)


def spec_body(spec: BaseModel | Mapping[str, Any] | None, fields: Mapping[str, Any]) -> dict[str, Any]:
    """A request body: `spec` (a model's set fields, or a mapping) with the non-None `fields` over it."""
    if isinstance(spec, BaseModel):
        body = spec.model_dump(mode="json", exclude_unset=True)
    else:
        body = dict(spec or {})
    body.update({name: value for name, value in fields.items() if value is not None})
    return body


def create_request(spec: Any, input: InputSource | None, file: InputSource | None, filename: str | None,
                   fields: Mapping[str, Any]) -> tuple[dict[str, Any], Upload | None]:
    """The spec body and, for anything but a URI, the upload. `spec` may itself be the input (a URI,
    a path, a table, ...) when it is neither a JobSpec nor a mapping."""
    if spec is not None and not isinstance(spec, JobSpec | Mapping):
        if input is not None:
            raise TypeError("give the input once: as the first argument or as input=")
        spec, input = None, spec
    if input is not None and file is not None:
        raise TypeError("give input= or file=, not both")
    source = input if input is not None else file
    body = spec_body(spec, fields)
    if source is None:
        return body, None
    if isinstance(source, str) and is_uri(source):
        body["input_uri"] = source
        return body, None
    return body, prepare_upload(source, filename)


def create_is_idempotent(body: Mapping[str, Any], upload: Upload | None) -> bool:
    """A submit may be retried only when the server recognises the repeat (an idempotency key) and
    the upload can be sent again from its start."""
    return bool(body.get("idempotency_key")) and (upload is None or upload.rewindable)


def retry_body(error_codes: Sequence[str] | None, idempotency_key: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {}
    if error_codes is not None:
        body["error_codes"] = list(error_codes)
    if idempotency_key is not None:
        body["idempotency_key"] = idempotency_key
    return body


def list_params(status: JobState | str | None, cursor: str | None, limit: int) -> dict[str, Any]:
    params: dict[str, Any] = {"limit": limit}
    if status:
        params["status"] = str(status)  # the server names an unknown status in its 422
    if cursor:
        params["cursor"] = cursor
    return params


class _Waiter:
    """The progress side of `wait`: a bar on a terminal, and the caller's callback."""

    def __init__(self, progress: bool, on_progress: ProgressCallback | None) -> None:
        self._bar = JobProgress() if wants_progress(progress) else None
        self._callback = on_progress

    def seen(self, status: JobStatus) -> None:
        if self._bar is not None:
            self._bar.update(status)
        if self._callback is not None:
            self._callback(status)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def _timed_out(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline


class Jobs:
    """`client.jobs`."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport

    def create(self, spec: JobSpec | Mapping[str, Any] | InputSource | None = None, *,
               input: InputSource | None = None, file: InputSource | None = None,
               filename: str | None = None, idempotency_key: str | None = None, **fields: Any) -> JobStatus:
        """Submit a job; returns its status (queued).

        The input: an `s3://` (or `file://`) URI the server reads; a local file path or binary file
        object, uploaded; or rows in memory (pyarrow Table, pandas DataFrame, list of dicts), written
        to a temp file and uploaded. `fields` (model=, prompt_column=, template=, image_column=,
        instructions=, sampling=, task="embed", dimensions=, max_length=, pooling=, normalize=, ...) add
        to or override `spec`.
        With `idempotency_key`, calling again with the same key and spec returns the same job (and is
        retried on errors); another spec is `ApiError` 409.
        """
        body, upload = create_request(spec, input, file, filename,
                                      {**fields, "idempotency_key": idempotency_key})
        idempotent = create_is_idempotent(body, upload)
        if upload is None:
            response = self._transport.request("POST", "/jobs", json=body, idempotent=idempotent)
            return JobStatus.model_validate(response.json())
        with upload:
            # httpx sends data fields before files, so the server reads the spec before the rows.
            response = self._transport.request("POST", "/jobs", data={"spec": json.dumps(body)},
                                               files=upload.files, idempotent=idempotent)
        return JobStatus.model_validate(response.json())

    def estimate(self, spec: JobSpec | Mapping[str, Any] | InputSource | None = None, *,
                 input: InputSource | None = None, file: InputSource | None = None,
                 filename: str | None = None, **fields: Any) -> JobEstimate:
        """What `create` with the same arguments would run, without creating anything (a dry run):
        rows, prompt tokens by the model's tokenizer, shared-prefix tokens, maximum output tokens,
        deduplicated rows and an estimated run time (None, with the reason, when unknown)."""
        body, upload = create_request(spec, input, file, filename, {**fields, "dry_run": True})
        if upload is None:
            response = self._transport.request("POST", "/jobs", json=body, idempotent=True)
            return JobEstimate.model_validate(response.json())
        with upload:
            response = self._transport.request("POST", "/jobs", data={"spec": json.dumps(body)},
                                               files=upload.files, idempotent=upload.rewindable)
        return JobEstimate.model_validate(response.json())

    def get(self, job: JobRef) -> JobStatus:
        response = self._transport.request("GET", f"/jobs/{job_id_of(job)}", idempotent=True)
        return JobStatus.model_validate(response.json())

    def spec(self, job: JobRef) -> JobSpec:
        """The spec the job runs, as stored (input format resolved)."""
        response = self._transport.request("GET", f"/jobs/{job_id_of(job)}/spec", idempotent=True)
        return JobSpec.model_validate(response.json())

    def page(self, status: JobState | str | None = None, cursor: str | None = None,
             limit: int = 50) -> JobPage:
        """One page of jobs, newest first; pass `next_cursor` back for the next."""
        response = self._transport.request("GET", "/jobs", params=list_params(status, cursor, limit),
                                           idempotent=True)
        return JobPage.model_validate(response.json())

    def list(self, status: JobState | str | None = None, *, page_size: int = 100,
             limit: int | None = None) -> Iterator[JobStatus]:
        """Every job (or the first `limit`), newest first, fetching pages as the iteration goes."""
        cursor: str | None = None
        seen = 0
        while True:
            page = self.page(status=status, cursor=cursor, limit=page_size)
            for job in page.jobs:
                if limit is not None and seen >= limit:
                    return
                seen += 1
                yield job
            if page.next_cursor is None:
                return
            cursor = page.next_cursor

    def cancel(self, job: JobRef) -> JobStatus:
        """Cancel a job that has not finished (again: no change); a finished one is `ApiError` 409."""
        response = self._transport.request("POST", f"/jobs/{job_id_of(job)}/cancel", idempotent=True)
        return JobStatus.model_validate(response.json())

    def wait(self, job: JobRef, *, poll_interval: float = 1.0, timeout: float | None = None,
             progress: bool = True, on_progress: ProgressCallback | None = None) -> JobStatus:
        """Poll until the job is final (succeeded, failed or cancelled) and return it; `WaitTimeout`
        after `timeout` seconds. `progress`: a bar on stderr when it is a terminal; `on_progress` sees
        every polled status."""
        deadline = _deadline(timeout)
        waiter = _Waiter(progress, on_progress)
        try:
            while True:
                status = self.get(job)
                waiter.seen(status)
                if status.state.is_terminal:
                    return status
                if _timed_out(deadline):
                    raise WaitTimeout(status, timeout or 0)
                time.sleep(poll_interval)
        finally:
            waiter.close()

    def result_parts(self, job: JobRef) -> JobResults:
        """The output and error parts of a succeeded job, with URLs to fetch them."""
        return Results(self._transport, job_id_of(job)).info

    def retry(self, job: JobRef, *, error_codes: Sequence[str] | None = None,
              idempotency_key: str | None = None) -> JobStatus:
        """A new job over the rows of this ended job that failed or never ran (same spec, its
        `parent_job_id` this job); `error_codes` narrows it (`not_run`: rows that never ran).
        `ApiError` 409 while the job runs, or when nothing qualifies."""
        response = self._transport.request("POST", f"/jobs/{job_id_of(job)}/retry",
                                           json=retry_body(error_codes, idempotency_key),
                                           idempotent=idempotency_key is not None)
        return JobStatus.model_validate(response.json())

    @overload
    def results(self, job: JobRef, *, partial: bool = False, merged: Literal[False] = False) -> Results: ...

    @overload
    def results(self, job: JobRef, *, partial: bool = False, merged: Literal[True]) -> MergedResults: ...

    def results(self, job: JobRef, *, partial: bool = False, merged: bool = False) -> Results | MergedResults:
        """The rows of a succeeded job: iterate, `.to_arrow()`, `.to_pandas()` or `.download(path)`.
        `partial=True`: also for a running, failed or cancelled job, the rows of the shards finished
        so far (`.partial` is then True unless it had succeeded). `merged=True`: one row per input
        row across the job and the jobs it retried, the latest success, else the latest error."""
        if merged:
            if partial:
                raise ValueError("merged results already take whatever each job has finished; omit partial")
            return MergedResults(self._transport, job_id_of(job))
        return Results(self._transport, job_id_of(job), partial)

    def download(self, job: JobRef, path: str | Path, *, partial: bool = False) -> Path:
        return self.results(job, partial=partial).download(path)


class AsyncJobs:
    """`async_client.jobs`: the same calls as `Jobs`, awaited; `list` is an async iterator."""

    def __init__(self, transport: AsyncTransport) -> None:
        self._transport = transport

    async def create(self, spec: JobSpec | Mapping[str, Any] | InputSource | None = None, *,
                     input: InputSource | None = None, file: InputSource | None = None,
                     filename: str | None = None, idempotency_key: str | None = None,
                     **fields: Any) -> JobStatus:
        body, upload = create_request(spec, input, file, filename,
                                      {**fields, "idempotency_key": idempotency_key})
        idempotent = create_is_idempotent(body, upload)
        if upload is None:
            response = await self._transport.request("POST", "/jobs", json=body, idempotent=idempotent)
            return JobStatus.model_validate(response.json())
        with upload:
            response = await self._transport.request("POST", "/jobs", data={"spec": json.dumps(body)},
                                                     files=upload.files, idempotent=idempotent)
        return JobStatus.model_validate(response.json())

    async def estimate(self, spec: JobSpec | Mapping[str, Any] | InputSource | None = None, *,
                       input: InputSource | None = None, file: InputSource | None = None,
                       filename: str | None = None, **fields: Any) -> JobEstimate:
        body, upload = create_request(spec, input, file, filename, {**fields, "dry_run": True})
        if upload is None:
            response = await self._transport.request("POST", "/jobs", json=body, idempotent=True)
            return JobEstimate.model_validate(response.json())
        with upload:
            response = await self._transport.request("POST", "/jobs", data={"spec": json.dumps(body)},
                                                     files=upload.files, idempotent=upload.rewindable)
        return JobEstimate.model_validate(response.json())

    async def get(self, job: JobRef) -> JobStatus:
        response = await self._transport.request("GET", f"/jobs/{job_id_of(job)}", idempotent=True)
        return JobStatus.model_validate(response.json())

    async def spec(self, job: JobRef) -> JobSpec:
        response = await self._transport.request("GET", f"/jobs/{job_id_of(job)}/spec", idempotent=True)
        return JobSpec.model_validate(response.json())

    async def page(self, status: JobState | str | None = None, cursor: str | None = None,
                   limit: int = 50) -> JobPage:
        response = await self._transport.request("GET", "/jobs", params=list_params(status, cursor, limit),
                                                 idempotent=True)
        return JobPage.model_validate(response.json())

    async def list(self, status: JobState | str | None = None, *, page_size: int = 100,
                   limit: int | None = None) -> AsyncIterator[JobStatus]:
        cursor: str | None = None
        seen = 0
        while True:
            page = await self.page(status=status, cursor=cursor, limit=page_size)
            for job in page.jobs:
                if limit is not None and seen >= limit:
                    return
                seen += 1
                yield job
            if page.next_cursor is None:
                return
            cursor = page.next_cursor

    async def cancel(self, job: JobRef) -> JobStatus:
        response = await self._transport.request("POST", f"/jobs/{job_id_of(job)}/cancel", idempotent=True)
        return JobStatus.model_validate(response.json())

    async def wait(self, job: JobRef, *, poll_interval: float = 1.0, timeout: float | None = None,
                   progress: bool = True, on_progress: ProgressCallback | None = None) -> JobStatus:
        deadline = _deadline(timeout)
        waiter = _Waiter(progress, on_progress)
        try:
            while True:
                status = await self.get(job)
                waiter.seen(status)
                if status.state.is_terminal:
                    return status
                if _timed_out(deadline):
                    raise WaitTimeout(status, timeout or 0)
                await asyncio.sleep(poll_interval)
        finally:
            waiter.close()

    async def result_parts(self, job: JobRef) -> JobResults:
        return await AsyncResults(self._transport, job_id_of(job)).info()

    async def retry(self, job: JobRef, *, error_codes: Sequence[str] | None = None,
                    idempotency_key: str | None = None) -> JobStatus:
        response = await self._transport.request("POST", f"/jobs/{job_id_of(job)}/retry",
                                                 json=retry_body(error_codes, idempotency_key),
                                                 idempotent=idempotency_key is not None)
        return JobStatus.model_validate(response.json())

    @overload
    def results(self, job: JobRef, *, partial: bool = False,
                merged: Literal[False] = False) -> AsyncResults: ...

    @overload
    def results(self, job: JobRef, *, partial: bool = False, merged: Literal[True]) -> AsyncMergedResults: ...

    def results(self, job: JobRef, *, partial: bool = False,
                merged: bool = False) -> AsyncResults | AsyncMergedResults:
        if merged:
            if partial:
                raise ValueError("merged results already take whatever each job has finished; omit partial")
            return AsyncMergedResults(self._transport, job_id_of(job))
        return AsyncResults(self._transport, job_id_of(job), partial)

    async def download(self, job: JobRef, path: str | Path, *, partial: bool = False) -> Path:
        return await self.results(job, partial=partial).download(path)
