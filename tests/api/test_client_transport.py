"""The SDK transport alone: which calls are retried, on what, how long it waits, what it raises and
what it sends. A real local HTTP server for the 503-503-200 case; httpx.MockTransport for the rest."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from bulkinfer.api.client import ApiError, AsyncClient, Client, JobState
from tests.fixtures.services import REPO_ROOT, free_port
from tests.support.http_server import serving

STATUS = {"job_id": "job-1", "state": "running"}


class FlakyServer(ThreadingHTTPServer):
    """Answers 503 to the first `failures` requests, then 200 with a job status; keeps the headers."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.seen: list[dict[str, str]] = []
        super().__init__(("127.0.0.1", free_port()), FlakyHandler)


class FlakyHandler(BaseHTTPRequestHandler):
    server: FlakyServer

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self.server.seen.append({name.lower(): value for name, value in self.headers.items()})
        failing = len(self.server.seen) <= self.server.failures
        body = json.dumps({"detail": "try later"} if failing else STATUS).encode()
        self.send_response(503 if failing else 200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args: object) -> None:
        pass


@pytest.fixture
def flaky() -> Iterator[FlakyServer]:
    with serving(FlakyServer(failures=2)) as server:
        yield server


def test_a_get_is_retried_through_two_503s_over_real_http_with_the_api_key(flaky) -> None:
    url = f"http://127.0.0.1:{flaky.server_address[1]}"
    with Client(url, api_key="secret-key", retries=3, backoff=0.01) as client:
        assert client.jobs.get("job-1").state == JobState.RUNNING
    assert len(flaky.seen) == 3
    assert {headers["authorization"] for headers in flaky.seen} == {"Bearer secret-key"}


def test_retries_run_out_with_the_last_error(flaky) -> None:
    url = f"http://127.0.0.1:{flaky.server_address[1]}"
    with Client(url, retries=1, backoff=0.01) as client, pytest.raises(ApiError) as error:
        client.jobs.get("job-1")
    assert (error.value.status_code, error.value.message, len(flaky.seen)) == (503, "try later", 2)


class Recorder:
    """A MockTransport handler that answers from a script and records each request."""

    def __init__(self, *answers: int | Exception | Callable[[httpx.Request], httpx.Response]) -> None:
        self.answers = list(answers)
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        if callable(answer):
            return answer(request)
        body = STATUS if answer < 400 else {"detail": f"status {answer}", "messages": ["one", "two"]}
        return httpx.Response(answer, json=body, headers={"Retry-After": "7"} if answer == 429 else {})


def client_for(recorder: Recorder, **options) -> tuple[Client, list[float]]:
    client = Client("http://api.test", http_transport=httpx.MockTransport(recorder), backoff=0.01, **options)
    sleeps: list[float] = []
    client._transport.sleep = sleeps.append  # record the backoff instead of sleeping
    return client, sleeps


def test_a_submit_without_an_idempotency_key_is_never_retried() -> None:
    recorder = Recorder(503)
    client, _ = client_for(recorder)
    with pytest.raises(ApiError) as error:
        client.jobs.create({"input_uri": "s3://b/rows.jsonl", "model": "tiny", "prompt_column": "q"})
    assert (error.value.status_code, error.value.messages, len(recorder.requests)) == (503, ["one", "two"], 1)
    connect = Recorder(httpx.ConnectError("refused"))
    client, _ = client_for(connect)
    with pytest.raises(httpx.ConnectError):
        client.jobs.create(input="s3://b/rows.jsonl", model="tiny", prompt_column="q")
    assert len(connect.requests) == 1


def test_a_submit_with_an_idempotency_key_is_retried_and_sends_the_same_body() -> None:
    recorder = Recorder(502, httpx.ConnectError("reset"), 201)
    client, sleeps = client_for(recorder, retries=3)
    job = client.jobs.create(input="s3://b/rows.jsonl", model="tiny", prompt_column="q", idempotency_key="k")
    assert job.job_id == "job-1" and len(recorder.requests) == 3 and len(sleeps) == 2
    bodies = {request.content for request in recorder.requests}
    assert len(bodies) == 1 and json.loads(bodies.pop())["idempotency_key"] == "k"


def test_an_upload_is_sent_whole_again_on_a_retry() -> None:
    recorder = Recorder(503, 201)
    client, _ = client_for(recorder)
    client.jobs.create([{"q": "one"}, {"q": "two"}], model="tiny", prompt_column="q", idempotency_key="u")
    def without_boundary(request: httpx.Request) -> bytes:
        boundary = request.headers["content-type"].split("boundary=")[1].encode()
        return request.read().replace(boundary, b"BOUNDARY")

    first, second = (without_boundary(request) for request in recorder.requests)
    assert first == second and b'{"q": "one"}\n{"q": "two"}\n' in first
    assert first.index(b'name="spec"') < first.index(b'name="file"')  # the spec goes before the rows


def test_429_waits_as_long_as_retry_after_says_and_4xx_is_not_retried() -> None:
    recorder = Recorder(429, 200)
    client, sleeps = client_for(recorder)
    assert client.jobs.cancel("job-1").job_id == "job-1"
    assert sleeps == [7.0]
    missing = Recorder(404)
    client, sleeps = client_for(missing)
    with pytest.raises(ApiError) as error:
        client.jobs.get("job-2")
    assert (error.value.status_code, len(missing.requests), sleeps) == (404, 1, [])


def test_backoff_doubles_with_jitter_up_to_a_cap() -> None:
    recorder = Recorder(500)
    client = Client("http://api.test", http_transport=httpx.MockTransport(recorder), retries=6, backoff=1.0)
    sleeps: list[float] = []
    client._transport.sleep = sleeps.append
    with pytest.raises(ApiError):
        client.jobs.get("job-1")
    bases = [1, 2, 4, 8, 8, 8]  # max_backoff 8
    assert len(sleeps) == 6
    assert all(base / 2 <= slept <= base for slept, base in zip(sleeps, bases, strict=True))


def test_result_parts_are_fetched_without_the_api_key_and_retried() -> None:
    part = {"shard_index": 0, "first_row": 0, "rows": 2, "bytes": 30, "sha256": "x",
            "uri": "s3://b/part-0.jsonl", "url": "http://s3.test/part-0.jsonl?sig=1"}
    listing = {"job_id": "job-1", "output_format": "jsonl", "rows": {"total": 2}, "usage": {},
               "parts": [part], "error_parts": []}
    part_calls: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.host == "api.test":
            return httpx.Response(200, json=listing)
        part_calls.append(request)
        if len(part_calls) == 1:
            return httpx.Response(503)
        return httpx.Response(200, content=b'{"id": "a"}\n{"id": "b"}\n')

    client, _ = client_for(Recorder(answer), api_key="secret")
    assert [row["id"] for row in client.jobs.results("job-1")] == ["a", "b"]
    assert len(part_calls) == 2 and all("authorization" not in request.headers for request in part_calls)


def test_the_async_client_retries_the_same_way() -> None:
    recorder = Recorder(503, httpx.ConnectError("refused"), 200)

    async def scenario() -> tuple[str, int]:
        async with AsyncClient("http://api.test", http_transport=httpx.MockTransport(recorder),
                               api_key="k", backoff=0.01) as client:
            job = await client.jobs.get("job-1")
            return job.job_id, len(recorder.requests)

    assert asyncio.run(scenario()) == ("job-1", 3)
    assert recorder.requests[0].headers["authorization"] == "Bearer k"
    once = Recorder(503)

    async def no_key() -> None:
        async with AsyncClient("http://api.test", http_transport=httpx.MockTransport(once)) as client:
            await client.jobs.create(input="s3://b/rows.jsonl", model="tiny", prompt_column="q")

    with pytest.raises(ApiError):
        asyncio.run(no_key())
    assert len(once.requests) == 1


def test_the_base_url_and_key_come_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("BULKINFER_API_URL", "http://from-env.test:9000")
    monkeypatch.setenv("BULKINFER_API_KEY", "env-key")
    recorder = Recorder(200)
    with Client(http_transport=httpx.MockTransport(recorder)) as client:
        client.jobs.get("job-1")
    assert str(recorder.requests[0].url) == "http://from-env.test:9000/jobs/job-1"
    assert recorder.requests[0].headers["authorization"] == "Bearer env-key"


SERVER_SIDE = ["torch", "engine", "worker", "fastapi", "uvicorn", "celery", "redis", "boto3", "botocore",
               "pandas"]


def test_the_sdk_and_the_job_commands_load_without_torch_or_server_packages() -> None:
    """What `pip install bulkinfer[client]` gives: the SDK and the CLI must not need anything else."""
    script = f"""
import sys
class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {SERVER_SIDE!r}:
            raise ImportError("not installed: " + name)
sys.meta_path.insert(0, Blocked())
from bulkinfer.api.client import AsyncClient, Client
import bulkinfer.api.cli.jobs
from bulkinfer.api.cli import main
assert main(["wait", "--help"]) == 0
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "exit codes: 0 succeeded, 1 failed" in done.stdout
