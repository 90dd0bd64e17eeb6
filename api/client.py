"""A small typed Python client for the bulkinfer API (httpx).

    with Client("http://127.0.0.1:8000") as client:
        job = client.jobs.create({"model": "small", "prompt_column": "q"}, file="rows.jsonl")
        job = client.jobs.wait(job.job_id, timeout=600)
        for row in client.jobs.results(job.job_id):
            print(row["text"])

Errors come back as `ApiError`, carrying the status code and the server's message.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import httpx
from pydantic import BaseModel

from jobs.spec import JobSpec
from jobs.status import JobState, JobStatus

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
UPLOAD_CHUNK_BYTES = 1 << 20


class ApiError(Exception):
    """The server refused a request: `status_code`, its `message`, and one line per problem."""

    def __init__(self, status_code: int, message: str, messages: list[str] | None = None) -> None:
        super().__init__(f"{status_code}: {message}")
        self.status_code = status_code
        self.message = message
        self.messages = messages or []


class JobPage(BaseModel):
    jobs: list[JobStatus]
    next_cursor: str | None = None


class ResultPart(BaseModel):
    shard_index: int
    first_row: int | None = None
    rows: int
    bytes: int
    sha256: str
    uri: str
    url: str


class JobResults(BaseModel):
    job_id: str
    output_format: str
    rows: dict[str, int]
    usage: dict[str, int]
    parts: list[ResultPart]
    error_parts: list[ResultPart]


def _raise_for_status(response: httpx.Response) -> None:
    if response.is_success:
        return
    if not response.is_stream_consumed:
        response.read()
    try:
        body = response.json()
        message, messages = str(body.get("detail", body)), list(body.get("messages") or [])
    except (ValueError, AttributeError):
        message, messages = response.text or response.reason_phrase, []
    raise ApiError(response.status_code, message, messages)


class Jobs:
    """`client.jobs`: create, get, list, cancel, wait for and read jobs."""

    def __init__(self, http: httpx.Client) -> None:
        self._http = http

    def create(self, spec: JobSpec | Mapping[str, Any] | None = None, *,
               file: str | Path | IO[bytes] | None = None, filename: str | None = None,
               **fields: Any) -> JobStatus:
        """Submit a job. With `file`, the file is uploaded (streamed) as the job's input and the
        spec leaves out `input_uri`; `fields` add to or override the spec's fields.
        """
        if isinstance(spec, JobSpec):
            body = spec.model_dump(mode="json", exclude_unset=True)
        else:
            body = dict(spec or {})
        body.update(fields)
        if file is None:
            return self._status(self._http.post("/jobs", json=body))
        if isinstance(file, str | Path):
            path = Path(file)
            with path.open("rb") as stream:
                return self._upload(body, stream, filename or path.name)
        return self._upload(body, file, filename or Path(getattr(file, "name", "input")).name)

    def _upload(self, body: dict[str, Any], stream: IO[bytes], filename: str) -> JobStatus:
        # httpx sends data fields before files, so the server reads the spec before the rows.
        response = self._http.post("/jobs", data={"spec": json.dumps(body)},
                                   files={"file": (filename, stream, "application/octet-stream")})
        return self._status(response)

    def get(self, job_id: str) -> JobStatus:
        return self._status(self._http.get(f"/jobs/{job_id}"))

    def spec(self, job_id: str) -> JobSpec:
        response = self._http.get(f"/jobs/{job_id}/spec")
        _raise_for_status(response)
        return JobSpec.model_validate(response.json())

    def list(self, status: JobState | str | None = None, cursor: str | None = None,
             limit: int = 50) -> JobPage:
        params: dict[str, Any] = {"limit": limit}
        if status:
            params["status"] = str(status)  # the server names an unknown status in its 422
        if cursor:
            params["cursor"] = cursor
        response = self._http.get("/jobs", params=params)
        _raise_for_status(response)
        return JobPage.model_validate(response.json())

    def iter(self, status: JobState | str | None = None, page_size: int = 100) -> Iterator[JobStatus]:
        """Every job, newest first, following cursors page by page."""
        cursor: str | None = None
        while True:
            page = self.list(status=status, cursor=cursor, limit=page_size)
            yield from page.jobs
            if page.next_cursor is None:
                return
            cursor = page.next_cursor

    def cancel(self, job_id: str) -> JobStatus:
        return self._status(self._http.post(f"/jobs/{job_id}/cancel"))

    def wait(self, job_id: str, poll_interval: float = 1.0, timeout: float | None = None,
             on_progress: Callable[[JobStatus], None] | None = None) -> JobStatus:
        """Poll until the job is final; `on_progress` sees each status. Raises `TimeoutError`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            status = self.get(job_id)
            if on_progress is not None:
                on_progress(status)
            if status.state.is_terminal:
                return status
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"job {job_id} is still {status.state.value} after {timeout}s")
            time.sleep(poll_interval)

    def result_parts(self, job_id: str) -> JobResults:
        """The output and error parts of a succeeded job, with URLs to fetch them."""
        response = self._http.get(f"/jobs/{job_id}/results")
        _raise_for_status(response)
        return JobResults.model_validate(response.json())

    def results(self, job_id: str) -> Iterator[dict[str, Any]]:
        """Every output row of a succeeded job, in input order, streamed from the server."""
        with self._http.stream("GET", f"/jobs/{job_id}/results", params={"download": "true"}) as response:
            _raise_for_status(response)
            for line in response.iter_lines():
                if line:
                    yield json.loads(line)

    @staticmethod
    def _status(response: httpx.Response) -> JobStatus:
        _raise_for_status(response)
        return JobStatus.model_validate(response.json())


class Client:
    def __init__(self, base_url: str = DEFAULT_BASE_URL, *, timeout: float = 30.0,
                 headers: Mapping[str, str] | None = None) -> None:
        self._http = httpx.Client(base_url=base_url, timeout=timeout, headers=dict(headers or {}))
        self.jobs = Jobs(self._http)

    def models(self) -> list[str]:
        response = self._http.get("/models")
        _raise_for_status(response)
        return list(response.json()["models"])

    def health(self) -> dict[str, Any]:
        """The health report; raises `ApiError` (503) when a backing service is down."""
        response = self._http.get("/healthz")
        _raise_for_status(response)
        return dict(response.json())

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()
