"""The sync SDK against a live deployment over real HTTP: every `client.jobs` call, each job outcome,
every input kind, the results reader, pagination and idempotency (see tests/api/live_stack.py)."""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Iterator

import httpx
import pandas
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rich.console import Console

from bulkinfer.api.client import ApiError, JobState, JobStatus, WaitTimeout
from bulkinfer.api.client.progress import JobProgress, wants_progress
from tests.api.live_stack import JOBS_BUCKET, LiveStack, live_stack

pytestmark = pytest.mark.timeout(300)

QUESTIONS = ["def add(a, b):", "import sys", "class Point:", "for i in range("]
ROWS = [{"id": f"q{n}", "q": q} for n, q in enumerate(QUESTIONS)] + [{"id": "no-q"}]  # the last one fails
SPEC = {"model": "tiny", "id_column": "id", "template": "Question: {q}", "instructions": "Answer briefly.",
        "sampling": {"temperature": 0, "max_tokens": 4}, "shard_size": 2}
JOB_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def stack(redis_server, s3_server, tiny_checkpoint, tmp_path_factory) -> Iterator[LiveStack]:
    with live_stack(redis_server, s3_server, tiny_checkpoint, tmp_path_factory.mktemp("model-cache")) as live:
        yield live


@pytest.fixture(scope="module")
def finished(stack: LiveStack) -> dict[str, JobStatus]:
    """Two real jobs side by side: rows from a list of dicts (JSONL) and from a pyarrow Table (Parquet)."""
    jsonl = stack.client.jobs.create(SPEC, input=ROWS)
    table = pa.table({"id": [f"t{n}" for n in range(len(QUESTIONS))], "q": QUESTIONS})
    parquet = stack.client.jobs.create(input=table, **SPEC)
    return {name: stack.client.jobs.wait(job, poll_interval=0.1, timeout=JOB_TIMEOUT_S)
            for name, job in (("jsonl", jsonl), ("parquet", parquet))}


def jsonl(rows: list[dict]) -> bytes:
    return b"".join(json.dumps(row).encode() + b"\n" for row in rows)


def small_job(stack: LiveStack, **changes) -> JobStatus:
    """A job no worker runs: planned, then `running` until cancelled."""
    uri = stack.put_input("small.jsonl", jsonl(ROWS[:3]))
    return stack.client.jobs.create(uri, **{"model": "small", "prompt_column": "q", **changes})


def server_download(stack: LiveStack, job_id: str) -> bytes:
    return httpx.get(f"{stack.url}/jobs/{job_id}/results", params={"download": "true"}).content


def test_rows_from_a_list_of_dicts_are_uploaded_run_and_read_back_in_order(stack, finished, tmp_path) -> None:
    job = finished["jsonl"]
    assert job.state == JobState.SUCCEEDED, job.error
    assert (job.rows.total, job.rows.succeeded, job.rows.failed) == (5, 4, 1)
    spec = stack.client.jobs.spec(job)
    assert spec.input_format == "jsonl" and spec.input_uri.endswith(f"/{job.job_id}/input/input.jsonl")
    assert stack.client.jobs.get(job.job_id).state == JobState.SUCCEEDED

    results = stack.client.jobs.results(job)
    rows = list(results)  # straight from the parts' presigned S3 URLs
    assert [row["id"] for row in rows] == ["q0", "q1", "q2", "q3", "no-q"]
    assert all(isinstance(row["text"], str) and row["error"] is None for row in rows[:4])
    assert rows[4]["error"]["code"] == "missing_column"
    assert rows == [json.loads(line) for line in server_download(stack, job.job_id).splitlines()]
    assert results.info.rows.failed == 1 and len(results.info.parts) == 3
    assert [part.uri for part in stack.client.jobs.result_parts(job.job_id).parts] == job.output_uris

    table = results.to_arrow()
    assert table.num_rows == 5 and table.column("id").to_pylist() == [row["id"] for row in rows]
    copied = results.download(tmp_path / "out" / "rows.jsonl")
    assert copied.read_bytes() == server_download(stack, job.job_id)  # JSONL parts, byte for byte
    as_parquet = stack.client.jobs.download(job, tmp_path / "rows.parquet")
    assert pq.read_table(as_parquet).column("text").to_pylist() == [row["text"] for row in rows]
    assert sorted(path.name for path in tmp_path.rglob("*")) == ["out", "rows.jsonl", "rows.parquet"]


def test_a_pyarrow_table_job_reads_back_as_arrow_pandas_and_files(stack, finished, tmp_path) -> None:
    job = finished["parquet"]
    assert job.state == JobState.SUCCEEDED, job.error
    results = stack.client.jobs.results(job)
    assert results.output_format == "parquet"
    table = results.to_arrow()
    assert table.column("id").to_pylist() == [f"t{n}" for n in range(len(QUESTIONS))]
    assert pa.types.is_integer(table.schema.field("completion_tokens").type)  # Parquet keeps its types
    rows = list(results)
    assert [row["text"] for row in rows] == table.column("text").to_pylist()
    assert rows == [json.loads(line) for line in server_download(stack, job.job_id).splitlines()]

    written = results.download(tmp_path / "all.parquet")
    assert pq.read_table(written).equals(table)
    lines = results.download(tmp_path / "all.jsonl").read_text().splitlines()
    assert [json.loads(line)["id"] for line in lines] == table.column("id").to_pylist()
    frame = results.to_pandas()
    assert list(frame["id"]) == table.column("id").to_pylist()
    assert list(frame["text"]) == [row["text"] for row in rows]


def test_to_pandas_without_pandas_says_what_to_install(stack, finished, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "pandas", None)  # as on an install without pandas
    with pytest.raises(ModuleNotFoundError, match="to_pandas needs pandas"):
        stack.client.jobs.results(finished["parquet"]).to_pandas()


def test_a_pandas_dataframe_is_uploaded_as_parquet(stack) -> None:
    frame = pandas.DataFrame({"id": ["d0", "d1"], "q": QUESTIONS[:2]})
    job = stack.client.jobs.create(frame, model="small", prompt_column="q", id_column="id")
    uri = stack.client.jobs.spec(job).input_uri
    assert uri.endswith(".parquet")
    bucket, key = uri.removeprefix("s3://").split("/", 1)
    body = stack.s3.client().get_object(Bucket=bucket, Key=key)["Body"].read()
    assert pq.read_table(io.BytesIO(body)).to_pylist() == frame.to_dict("records")


def test_an_s3_uri_a_local_path_and_a_file_object_are_each_submitted_as_given(stack, tmp_path) -> None:
    uri = stack.put_input("given.jsonl", jsonl(ROWS[:3]))
    by_uri = stack.client.jobs.create(uri, model="small", prompt_column="q")
    assert stack.client.jobs.spec(by_uri).input_uri == uri
    path = tmp_path / "local.jsonl"
    path.write_bytes(jsonl(ROWS[:3]))
    by_path = stack.client.jobs.create({"model": "small", "prompt_column": "q"}, input=path)
    uploaded = stack.client.jobs.spec(by_path).input_uri
    assert uploaded == f"s3://{JOBS_BUCKET}/bulkinfer/jobs/{by_path.job_id}/input/local.jsonl"
    by_stream = stack.client.jobs.create(model="small", prompt_column="q", file=io.BytesIO(path.read_bytes()),
                                         filename="stream.jsonl")
    assert stack.client.jobs.spec(by_stream).input_uri.endswith("/input/stream.jsonl")
    assert {job.state for job in (by_uri, by_path, by_stream)} == {JobState.QUEUED}


def test_list_iterates_over_every_page_newest_first(stack) -> None:
    for n in range(3):
        small_job(stack, metadata={"n": str(n)})
    everything = [job.job_id for job in stack.client.jobs.page(limit=1000).jobs]
    assert len(everything) >= 3
    assert [job.job_id for job in stack.client.jobs.list(page_size=2)] == everything  # > 1 page
    assert [job.job_id for job in stack.client.jobs.list(page_size=2, limit=3)] == everything[:3]
    first = stack.client.jobs.page(limit=2)
    assert len(first.jobs) == 2 and first.next_cursor is not None
    queued_or_running = {job.state for job in stack.client.jobs.list(status="running")}
    assert queued_or_running <= {JobState.RUNNING}


def test_wait_cancel_and_results_report_each_outcome(stack, finished) -> None:
    stuck = small_job(stack)
    with pytest.raises(WaitTimeout) as timeout:
        stack.client.jobs.wait(stuck, poll_interval=0.05, timeout=0.3)
    assert timeout.value.status.job_id == stuck.job_id and not timeout.value.status.state.is_terminal
    assert str(timeout.value).startswith(f"job {stuck.job_id} is still ")

    cancelled = stack.client.jobs.cancel(stuck)
    assert cancelled.state == JobState.CANCELLED and cancelled.finished_at is not None
    assert stack.client.jobs.cancel(stuck.job_id).state == JobState.CANCELLED  # again: no change
    assert stack.client.jobs.wait(stuck, timeout=5).state == JobState.CANCELLED
    with pytest.raises(ApiError) as not_ready:
        list(stack.client.jobs.results(stuck))
    assert not_ready.value.status_code == 409 and "results are ready once it has succeeded" in \
        not_ready.value.message

    retired = small_job(stack, model="retired")
    failed = stack.client.jobs.wait(retired, poll_interval=0.1, timeout=JOB_TIMEOUT_S)
    assert failed.state == JobState.FAILED and "retired" in failed.error

    done = finished["jsonl"]
    with pytest.raises(ApiError) as too_late:
        stack.client.jobs.cancel(done)
    assert (too_late.value.status_code, too_late.value.message) == (
        409, f"job {done.job_id} already succeeded; there is nothing to cancel")


def test_the_same_idempotency_key_is_the_same_job_and_another_spec_is_a_clear_409(stack) -> None:
    uri = stack.put_input("nightly.jsonl", jsonl(ROWS[:3]))
    first = stack.client.jobs.create(uri, model="small", prompt_column="q", idempotency_key="nightly-7")
    again = stack.client.jobs.create(uri, model="small", prompt_column="q", idempotency_key="nightly-7")
    assert again.job_id == first.job_id
    with pytest.raises(ApiError) as conflict:
        stack.client.jobs.create(uri, model="small", template="{q}", idempotency_key="nightly-7")
    assert conflict.value.status_code == 409
    assert conflict.value.message == (f"idempotency key 'nightly-7' was already used for job {first.job_id} "
                                      "with a different spec; use a new key for a different job")

    upload = stack.client.jobs.create(ROWS[:3], model="small", prompt_column="q", idempotency_key="rows-7")
    assert stack.client.jobs.create(ROWS[:3], model="small", prompt_column="q",
                                    idempotency_key="rows-7").job_id == upload.job_id
    with pytest.raises(ApiError) as other_rows:
        stack.client.jobs.create(ROWS[:2], model="small", prompt_column="q", idempotency_key="rows-7")
    assert other_rows.value.status_code == 409
    assert other_rows.value.message == "idempotency_key 'rows-7' was already used with a different file"


def test_errors_carry_the_status_code_and_the_servers_message(stack) -> None:
    with pytest.raises(ApiError) as missing:
        stack.client.jobs.get("job-nope")
    assert (missing.value.status_code, missing.value.message) == (404, "no job 'job-nope'")
    uri = stack.put_input("errors.jsonl", jsonl(ROWS[:2]))
    with pytest.raises(ApiError) as invalid:
        stack.client.jobs.create(uri, model="tiny", prompt_column="q", shard_size=0)
    assert invalid.value.status_code == 422 and invalid.value.messages[0].startswith("shard_size:")
    with pytest.raises(ApiError) as unknown:
        stack.client.jobs.create(uri, model="gpt-9", prompt_column="q")
    assert unknown.value.status_code == 400 and "retired, small, tiny" in unknown.value.message
    with pytest.raises(FileNotFoundError, match="is not a file"):
        stack.client.jobs.create("/no/such/rows.jsonl", model="tiny", prompt_column="q")
    with pytest.raises(TypeError, match="cannot use a int"):
        stack.client.jobs.create(input=42, model="tiny", prompt_column="q")
    with pytest.raises(TypeError, match="row 1 of the input is a str"):
        stack.client.jobs.create([{"q": "a"}, "b"], model="tiny", prompt_column="q")
    assert stack.client.models() == ["retired", "small", "tiny"]
    assert stack.client.health()["status"] == "ok"


def test_wait_draws_progress_only_on_a_terminal_and_calls_on_progress(stack, finished, capsys) -> None:
    seen: list[JobStatus] = []
    stack.client.jobs.wait(finished["jsonl"], progress=True, on_progress=seen.append)
    assert [status.job_id for status in seen] == [finished["jsonl"].job_id]
    assert capsys.readouterr().err == ""  # pytest's stderr is not a terminal

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert wants_progress(True, Terminal()) and not wants_progress(False, Terminal())
    screen = io.StringIO()
    bar = JobProgress(Console(file=screen, force_terminal=True, width=160))
    bar.update(finished["jsonl"])
    bar.close()
    assert "5/5 rows" in screen.getvalue() and "(1 failed)" in screen.getvalue()
