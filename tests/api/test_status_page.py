"""The status page (/ui) in a real browser (headless Chromium) against a running stack with API keys:
a tenant's job in flight appears with its progress advancing, the worker is listed with its model
and dtype, the job's page shows counts, a chart, and output links once it succeeded; without a key
the page shows nothing but the key form. A failing check writes a screenshot."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from bulkinfer.jobs.state.status import JobState
from tests.api.live_stack import INPUTS_BUCKET, LiveStack, live_stack
from tests.fixtures.services import RedisServer, S3Server
from tests.support.browser import Element, chromium, dump_dom, parse, screenshot

pytestmark = pytest.mark.timeout(600)

KEY = "acme-secret"
SHARDS, ROWS_PER_SHARD = 16, 8  # 200 tokens a row: the job runs for many seconds


@pytest.fixture(scope="module")
def browser() -> str:
    return chromium()


@pytest.fixture(scope="module")
def stack(redis_server: RedisServer, s3_server: S3Server, tiny_checkpoint: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveStack]:
    with live_stack(redis_server, s3_server, tiny_checkpoint, tmp_path_factory.mktemp("model-cache"),
                    models={"tiny": str(tiny_checkpoint)}, settings_fields={"api_keys": f"acme={KEY}",
                                                                 "tenant_prefixes": {"acme": [f"s3://{INPUTS_BUCKET}/"]}},
                    client_options={"timeout": 30, "api_key": KEY}) as live:
        yield live


def page(browser: str, url: str) -> Element:
    return parse(dump_dom(browser, url))


def until(check: Callable[[], Element | None], timeout: float, what: str, browser: str, url: str,
          shot: Path) -> Element:
    """Reload the page until `check` finds what it wants; else a screenshot and a failure."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found is not None:
            return found
        time.sleep(0.5)
    screenshot(browser, url, shot)
    raise AssertionError(f"the page never showed {what} within {timeout}s (screenshot: {shot})")


def test_a_job_in_flight_appears_and_its_progress_advances(stack: LiveStack, browser: str,
                                                          tmp_path: Path) -> None:
    rows = SHARDS * ROWS_PER_SHARD
    lines = [json.dumps({"id": f"r{n}", "q": f"def f{n}(x):"}) for n in range(rows)]
    spec = {"input_uri": stack.put_input("ui.jsonl", "\n".join(lines).encode()), "model": "tiny",
            "prompt_column": "q", "id_column": "id", "shard_size": ROWS_PER_SHARD,
            "sampling": {"temperature": 0.0, "max_tokens": 200}}
    job_id = stack.client.jobs.create(spec).job_id
    overview = f"{stack.url}/ui#key={KEY}"

    def job_row(minimum_done: int) -> Callable[[], Element | None]:
        def check() -> Element | None:
            for row in page(browser, overview).find_all("tr", data_job_id=job_id):
                bar = row.find_all("progress")[0]
                if int(bar.attributes["data-done"] or 0) >= minimum_done:
                    return row
            return None
        return check

    first = until(job_row(0), 60, f"job {job_id}", browser, overview, tmp_path / "overview.png")
    first_done = int(first.find_all("progress")[0].attributes["data-done"] or 0)
    assert first_done < rows, "the job finished before the page first showed it: no progress to watch"
    later = until(job_row(first_done + 1), 240, "the job's progress advance", browser, overview,
                  tmp_path / "overview.png")
    assert later.attributes["data-state"] in {"running", "finalizing", "succeeded"}

    # The worker is listed with its model, dtype and device.
    def worker_row() -> Element | None:
        rows = [row for row in page(browser, overview).by_id("workers").find_all("tr")
                if "data-worker" in row.attributes]
        shown = rows[0].text if rows else ""  # the dtype is the machine's choice (auto)
        return rows[0] if "tinyloaded" in shown and ("float32" in shown or "bfloat16" in shown) else None

    until(worker_row, 120, "the worker with its model loaded", browser, overview, tmp_path / "workers.png")

    status = stack.client.jobs.wait(job_id, poll_interval=0.2, timeout=300)
    assert status.state == JobState.SUCCEEDED, status.error
    job_page = f"{stack.url}/ui?job={job_id}#key={KEY}"

    def finished() -> Element | None:
        document = page(browser, job_page)
        state, outputs = document.by_id("job-state"), document.by_id("job-outputs")
        if state is None or state.text != "succeeded" or outputs is None or not outputs.find_all("a"):
            return None
        return document

    document = until(finished, 60, "the finished job with its outputs", browser, job_page,
                     tmp_path / "job.png")
    counts = document.by_id("job-counts").text
    assert f"{rows} of {rows} rows (0 failed), {SHARDS} of {SHARDS} shards" in counts
    assert document.by_id("chart").find_all("polyline"), "no throughput chart"
    links = document.by_id("job-outputs").find_all("a")
    assert len(links) == 2 * SHARDS  # an output part and an error part a shard
    assert all(link.attributes["href"].startswith("http") for link in links)


def test_without_a_key_the_page_shows_only_the_key_form(stack: LiveStack, browser: str) -> None:
    hidden = {"input_uri": stack.put_input("hidden.jsonl", b'{"q": "def f(x):"}\n'), "model": "tiny",
              "prompt_column": "q", "sampling": {"max_tokens": 4}}
    stack.client.jobs.create(hidden)  # a job the page must not show without the key
    document = page(browser, f"{stack.url}/ui")
    assert "hidden" not in document.by_id("key-form").attributes
    assert not [row for row in document.by_id("jobs").find_all("tr") if "data-job-id" in row.attributes]
    assert "needs a key" in document.by_id("error").text
