"""No single request takes the API's memory past a fixed bound or stalls other callers: the API
runs as its own process (`bulkinfer serve api`), and its peak resident memory (the kernel's
high-water mark, VmHWM) stays under 300 MiB above idle through a 64 MiB message batch of 100,000
small requests, one of a few very long strings, and 300 MiB bodies of any content type to the JSON
routes, while `/healthz` keeps answering within a second."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.api.conftest import MODELS
from tests.fixtures.services import REPO_ROOT, free_port, wait_until

pytestmark = pytest.mark.timeout(300)

MiB = 1 << 20
PEAK_BOUND = 300 * MiB
HEALTH_BOUND_S = 1.0
BATCH_LIMIT = 64 * MiB  # max_message_batch_bytes's default


def peak_rss(pid: int) -> int:
    """The process's peak resident memory so far, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc status")


WATCH = """
import sys, time, httpx
slowest, answers = 0.0, 0
with httpx.Client(timeout=30) as client:
    while sys.stdin.readline():  # a line from the test: one more look
        started = time.monotonic()
        assert client.get(sys.argv[1] + "/healthz").status_code == 200
        slowest, answers = max(slowest, time.monotonic() - started), answers + 1
print(slowest, answers)
"""


class HealthWatch:
    """Polls /healthz while a big request runs, from a process of its own (the test's own threads
    share its interpreter with the client sending the body); the slowest answer it saw."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.slowest = 0.0
        self.answers = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick, daemon=True)
        self._process = subprocess.Popen([sys.executable, "-c", WATCH, url], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True)

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        out, _ = self._process.communicate(timeout=30)
        slowest, answers = out.split()
        self.slowest, self.answers = float(slowest), int(answers)

    def _tick(self) -> None:
        assert self._process.stdin is not None
        while not self._stop.wait(0.1):
            self._process.stdin.write("\n")
            self._process.stdin.flush()


@pytest.fixture(scope="module")
def api_process(redis_server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    port = free_port()
    store = tmp_path_factory.mktemp("memory-store")
    env = {**os.environ, "BULKINFER_BROKER_URL": redis_server.url, "BULKINFER_STORE_URI": str(store),
           "BULKINFER_MODELS": json.dumps(MODELS),
           "BULKINFER_MODEL_ALIASES": json.dumps({"claude-haiku-4-5": "tiny"})}
    command = [sys.executable, "-m", "bulkinfer.api.cli", "serve", "api", "--port", str(port)]
    process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: httpx.get(f"{url}/healthz", timeout=1).status_code == 200, timeout=60,
                   what="serve api")
        yield url, process.pid
    finally:
        process.terminate()
        process.wait(timeout=20)


@pytest.fixture(scope="module")
def idle_rss(api_process: tuple[str, int]) -> int:
    """The API's peak after a small batch and a few requests: its imports and pools are all in."""
    url, pid = api_process
    created = httpx.post(f"{url}/v1/messages/batches", content=batch_body(3, "hello"), timeout=30,
                         headers={"content-type": "application/json"})
    assert created.status_code == 200, created.text
    for _ in range(3):
        httpx.get(f"{url}/healthz")
    return peak_rss(pid)


def batch_body(count: int, content: str) -> bytes:
    request = {"custom_id": "r{}", "params": {"model": "claude-haiku-4-5", "max_tokens": 64,
                                               "messages": [{"role": "user", "content": content}]}}
    template = json.dumps(request, ensure_ascii=False)
    requests = ",".join(template.replace("r{}", f"r{i}", 1) for i in range(count))
    return b'{"requests":[' + requests.encode() + b"]}"


def under_watch(url: str, pid: int, idle: int, send) -> httpx.Response:  # noqa: ANN001
    with HealthWatch(url) as health:
        answer = send()
    grown = peak_rss(pid) - idle
    assert grown < PEAK_BOUND, f"the API's peak grew {grown / MiB:.0f} MiB above idle"
    assert health.answers > 0 and health.slowest < HEALTH_BOUND_S, \
        f"/healthz took {health.slowest:.2f} s while the request ran"
    return answer


def create_batch(url: str, body: bytes) -> httpx.Response:
    return httpx.post(f"{url}/v1/messages/batches", content=body, timeout=240,
                      headers={"content-type": "application/json"})


def test_a_64_mib_message_batch_of_100000_requests_is_created_in_bounded_memory(api_process,
                                                                                 idle_rss) -> None:
    url, pid = api_process
    body = batch_body(100_000, "Summarise this support ticket in one line. " * 12)
    assert 60 * MiB < len(body) <= BATCH_LIMIT
    answer = under_watch(url, pid, idle_rss, lambda: create_batch(url, body))
    assert answer.status_code == 200, answer.text[:500]
    assert answer.json()["request_counts"]["processing"] == 100_000


@pytest.mark.parametrize(("count", "text"), [(3, "é🙂 long document " * (20 * MiB // 21)),  # not ASCII
                                             (1, "long document " * (60 * MiB // 14))])
def test_a_batch_of_a_few_very_long_strings_is_created_in_bounded_memory(api_process, idle_rss, count: int,
                                                                        text: str) -> None:
    url, pid = api_process
    body = batch_body(count, text)
    assert 55 * MiB < len(body) <= BATCH_LIMIT
    answer = under_watch(url, pid, idle_rss, lambda: create_batch(url, body))
    assert answer.status_code == 200, answer.text[:500]
    assert answer.json()["request_counts"]["processing"] == count


def chunks_of(total: int, head: bytes = b'{"requests":[') -> Iterator[bytes]:
    """`total` bytes sent without a length (chunked), so nothing is refused before it is read."""
    yield head
    sent, piece = len(head), b"x" * MiB
    while sent < total:
        yield piece
        sent += len(piece)


# Every content type to the route that takes the biggest body, and one other to each other route.
CONTENT_TYPES = ("application/json", "multipart/form-data; boundary=xyz", "text/plain",
                 "application/octet-stream")
SENT = [("/v1/messages/batches", content_type) for content_type in CONTENT_TYPES] + [
    ("/v1/batches", "multipart/form-data; boundary=xyz"), ("/v1/files", "application/json"),
    ("/jobs/job-x/retry", "text/plain"), ("/jobs", "application/octet-stream"),
    ("/v1/files", "multipart/form-data; boundary=xyz")]


@pytest.mark.parametrize(("path", "content_type"), SENT)
def test_a_300_mib_body_of_any_content_type_is_413_in_bounded_memory(api_process, idle_rss, path: str,
                                                                     content_type: str) -> None:
    """(A multipart body to /v1/files is an upload: read through to its end up to max_upload_bytes, it
    is refused as malformed, having held no more than a piece of it.)"""
    url, pid = api_process

    def send() -> httpx.Response | None:
        try:
            return httpx.post(f"{url}{path}", content=chunks_of(300 * MiB), timeout=120,
                              headers={"content-type": content_type})
        except httpx.TransportError:  # the API answered and closed before all 300 MiB were sent
            return None

    answer = under_watch(url, pid, idle_rss, send)
    if answer is not None:
        assert answer.status_code in (400, 413, 415, 422), answer.text[:300]
