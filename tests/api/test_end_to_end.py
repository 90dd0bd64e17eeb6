"""Whole jobs over HTTP: API → Redis/Celery → a real worker process (tiny model) → moto S3 → API.

One worker process serves the module. Redis is flushed once, at the start: a flush between tests
would delete the worker's queue bindings, so tests here never use `redis_url` or `s3`.
"""

from __future__ import annotations

import csv
import io
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest

from bulkinfer.api.cli.jobs import EXIT_SUCCEEDED, results, submit
from bulkinfer.api.client import Client
from bulkinfer.engine import LLM, SamplingParams
from bulkinfer.jobs.names import QUEUE_PREFIX
from bulkinfer.jobs.state.repository import JobRepository
from bulkinfer.jobs.state.status import JobState, JobStatus
from tests.api.live_stack import live_stack
from tests.fixtures.services import RedisServer, S3Server

pytestmark = pytest.mark.timeout(300)

JOBS_BUCKET = "e2e-jobs"
INPUTS_BUCKET = "e2e-inputs"
# dtype pinned: outputs are compared with an fp32 offline engine.
ENGINE_OPTIONS = {"max_model_len": 256, "num_kv_blocks": 256, "max_num_seqs": 16,
                  "dtype": "float32"}
MAX_TOKENS = 6
INSTRUCTIONS = "Complete the Python line, in the style of the standard library. " * 4  # several KV blocks
QUESTIONS = ["def add(a, b):", "import sys\n", "class Point:", "for i in range(", "while True:",
             "return x +", "import os\n", "if __name__ ==", "def main():", "print("]
JOB_TIMEOUT_S = 120


@dataclass
class Deployment:
    client: Client
    url: str
    repository: JobRepository
    s3: S3Server
    broker_url: str

    def put_input(self, name: str, body: bytes) -> str:
        self.s3.client().put_object(Bucket=INPUTS_BUCKET, Key=name, Body=body)
        return f"s3://{INPUTS_BUCKET}/{name}"


@pytest.fixture(scope="module")
def deployment(redis_server: RedisServer, s3_server: S3Server, tiny_checkpoint: Path,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    with live_stack(redis_server, s3_server, tiny_checkpoint, tmp_path_factory.mktemp("model-cache"),
                    models={"tiny": str(tiny_checkpoint)}, jobs_bucket=JOBS_BUCKET,
                    inputs_bucket=INPUTS_BUCKET, engine_options=ENGINE_OPTIONS,
                    client_options={"timeout": 30}) as live:
        yield Deployment(live.client, live.url, live.repository, live.s3, redis_server.url)


@pytest.fixture(scope="module")
def offline(tiny_checkpoint: Path) -> LLM:
    return LLM(str(tiny_checkpoint), **ENGINE_OPTIONS)


def greedy(llm: LLM, prompts: list) -> list[str]:
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    return [output.text for output in outputs]


def greedy_chat(llm: LLM, texts: list[str], instructions: str | None = None) -> list[str]:
    """What plain rows get on a model with a chat template (the tiny checkpoint has ChatML): each
    text as the user's turn, under the instructions as the system message."""
    system = [{"role": "system", "content": instructions}] if instructions else []
    conversations = [[*system, {"role": "user", "content": text}] for text in texts]
    outputs = llm.chat(conversations, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    return [output.text for output in outputs]


def wait(deployment: Deployment, job_id: str) -> JobStatus:
    status = deployment.client.jobs.wait(job_id, poll_interval=0.1, timeout=JOB_TIMEOUT_S)
    assert status.state == JobState.SUCCEEDED, status.error
    return status


SAMPLING = {"temperature": 0.0, "max_tokens": MAX_TOKENS}


def test_a_parquet_job_returns_every_row_once_in_order_equal_to_offline_greedy_output(
        deployment: Deployment, offline: LLM) -> None:
    table = pa.table({"id": [f"q{n}" for n in range(len(QUESTIONS))], "q": QUESTIONS})
    buffer = io.BytesIO()
    pq.write_table(table, buffer, row_group_size=3)
    job = deployment.client.jobs.create({
        "input_uri": deployment.put_input("questions.parquet", buffer.getvalue()), "model": "tiny",
        "id_column": "id", "prompt_column": "q", "instructions": INSTRUCTIONS, "sampling": SAMPLING,
        "shard_size": 3})

    status = wait(deployment, job.job_id)

    rows = list(deployment.client.jobs.results(job.job_id))
    assert [row["id"] for row in rows] == [f"q{n}" for n in range(len(QUESTIONS))]
    assert [row["text"] for row in rows] == greedy_chat(offline, QUESTIONS, INSTRUCTIONS)
    assert (status.rows.total, status.rows.succeeded, status.rows.failed) == (10, 10, 0)
    assert (status.shards.done, status.shards.total) == (4, 4)
    assert status.usage.completion == sum(row["completion_tokens"] for row in rows)  # Parquet: flat columns
    assert status.usage.cached > 0  # the shared instruction came from the prefix cache
    parts = deployment.client.jobs.result_parts(job.job_id)
    first = pq.read_table(io.BytesIO(httpx.get(parts.parts[0].url).content))
    assert first.column("id").to_pylist() == ["q0", "q1", "q2"]


def test_an_uploaded_jsonl_job_reports_bad_rows_and_still_succeeds(deployment: Deployment,
                                                                   offline: LLM) -> None:
    rows = [{"id": "ok-1", "question": QUESTIONS[0]},
            "{this line is not json",
            {"id": "no-question"},
            {"id": "too-long", "question": "word " * 300},
            {"id": "ok-2", "question": QUESTIONS[1]}]
    lines = [row if isinstance(row, str) else json.dumps(row) for row in rows]
    body = "".join(line + "\n" for line in lines).encode()
    job = deployment.client.jobs.create({"model": "tiny", "id_column": "id", "template": "{question}",
                                         "sampling": SAMPLING, "shard_size": 2},
                                        file=io.BytesIO(body), filename="mixed.jsonl")

    status = wait(deployment, job.job_id)

    results = list(deployment.client.jobs.results(job.job_id))
    bad_json_id = str(len(lines[0]) + 1)  # a line that is not JSON is named by its byte offset
    assert [row["id"] for row in results] == ["ok-1", bad_json_id, "no-question", "too-long", "ok-2"]
    codes = [(row["error"] or {}).get("code") for row in results]
    assert codes == [None, "invalid_json", "missing_column", "prompt_too_long", None]
    assert [results[0]["text"], results[4]["text"]] == greedy_chat(offline, QUESTIONS[:2])
    assert (status.rows.total, status.rows.succeeded, status.rows.failed) == (5, 2, 3)
    error_parts = deployment.client.jobs.result_parts(job.job_id).error_parts
    assert sum(part.rows for part in error_parts) == 3


def test_an_openai_batch_job_answers_each_custom_id_once_in_order(deployment: Deployment,
                                                                  offline: LLM) -> None:
    def line(custom_id: str, url: str, body: dict) -> str:
        return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})

    knobs = {"model": "gpt-4o-mini", "max_tokens": MAX_TOKENS, "temperature": 0}
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS[:4]]
    lines = [line(f"chat-{n}", "/v1/chat/completions", {**knobs, "messages": messages})
             for n, messages in enumerate(chats)]
    lines.append(line("completion", "/v1/completions", {**knobs, "prompt": QUESTIONS[5]}))
    uri = deployment.put_input("batch.jsonl", "\n".join(lines).encode())
    job = deployment.client.jobs.create({"input_uri": uri, "model": "tiny", "shard_size": 2})

    wait(deployment, job.job_id)

    records = list(deployment.client.jobs.results(job.job_id))
    assert [record["custom_id"] for record in records] == [f"chat-{n}" for n in range(4)] + ["completion"]
    assert all(record["error"] is None and record["response"]["status_code"] == 200 for record in records)
    assert records[0]["response"]["body"]["object"] == "chat.completion"
    completion = records[4]["response"]["body"]
    assert completion["object"] == "text_completion"
    assert completion["choices"][0]["text"] == greedy(offline, [QUESTIONS[5]])[0]


def test_a_csv_job_from_the_cli_answers_every_row_in_order_and_downloads_as_csv(
        deployment: Deployment, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = io.StringIO()  # as a spreadsheet writes it: quoted cells, one holding a newline, CRLF
    cells = [[f"0{n}", q, "" if n == 2 else f"t{n}"] for n, q in enumerate(QUESTIONS[:5])]
    csv.writer(text).writerows([["id", "q", "team"], *cells])
    source = tmp_path / "questions.csv"
    source.write_bytes(("\ufeff" + text.getvalue() + "9,a row,with,too many fields\r\n").encode())
    api = ["--api-url", deployment.url]

    code = submit([str(source), "--model", "tiny", "--prompt-column", "q", "--id-column", "id",
                   "--max-tokens", str(MAX_TOKENS), "--temperature", "0", "--shard-size", "2", "--spec",
                   json.dumps({"passthrough_columns": ["team"]}), "--wait", "--no-progress", "--json", *api])

    assert code == EXIT_SUCCEEDED, capsys.readouterr().err
    job_id = json.loads(capsys.readouterr().out)["job_id"]
    spec = deployment.client.jobs.spec(job_id)
    assert (spec.input_format, spec.output_format) == ("csv", "csv")
    rows = list(deployment.client.jobs.results(job_id))  # read from the CSV parts themselves
    assert [row["id"] for row in rows] == ["00", "01", "02", "03", "04", "5"]
    as_jsonl = deployment.client.jobs.create({"model": "tiny", "prompt_column": "q", "sampling": SAMPLING},
                                             input=[{"q": q} for q in QUESTIONS[:5]])
    wait(deployment, as_jsonl.job_id)  # the same rows as JSONL: the same answers
    jsonl_rows = list(deployment.client.jobs.results(as_jsonl))
    assert [row["text"] for row in rows[:5]] == [row["text"] for row in jsonl_rows]
    assert [row["team"] for row in rows] == ["t0", "t1", None, "t3", "t4", None]
    assert rows[5]["error_code"] == "invalid_row" and "Expected 3 columns, got 4" in rows[5]["error"]
    assert all(row["completion_tokens"] == MAX_TOKENS for row in rows[:5])
    streamed = httpx.get(f"{deployment.url}/jobs/{job_id}/results", params={"download": "true"})
    assert [json.loads(line) for line in streamed.text.splitlines()] == rows
    parts = deployment.client.jobs.result_parts(job_id).parts
    assert [part.uri.rsplit("/", 1)[-1] for part in parts] == ["part-00000.csv", "part-00001.csv",
                                                              "part-00002.csv"]

    for name in ("answers.csv", "answers.parquet"):
        assert results([job_id, "-o", str(tmp_path / name), *api]) == EXIT_SUCCEEDED
    capsys.readouterr()
    downloaded = pa_csv.read_csv(  # one header row over the three parts
        tmp_path / "answers.csv", parse_options=pa_csv.ParseOptions(newlines_in_values=True),
        convert_options=pa_csv.ConvertOptions(column_types={"id": pa.string()}))
    assert downloaded.column("id").to_pylist() == [row["id"] for row in rows]
    assert downloaded.column("text").to_pylist()[:5] == [row["text"] for row in rows[:5]]
    assert pq.read_table(tmp_path / "answers.parquet").column("id").to_pylist() == [row["id"] for row in rows]


def test_counts_move_while_a_job_runs_and_cancel_stops_it(deployment: Deployment) -> None:
    rows = [json.dumps({"q": QUESTIONS[n % len(QUESTIONS)] + f" # {n}"}) for n in range(48)]
    job = deployment.client.jobs.create({
        "input_uri": deployment.put_input("many.jsonl", "\n".join(rows).encode()), "model": "tiny",
        "prompt_column": "q", "sampling": {"temperature": 0.0, "max_tokens": 24}, "shard_size": 2})
    seen: list[JobStatus] = []
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not any(0 < s.rows.succeeded and s.rows.pending > 0 for s in seen):
        assert time.monotonic() < deadline, f"no progress seen: {seen[-1] if seen else None}"
        status = deployment.client.jobs.get(job.job_id)
        assert not status.state.is_terminal, "the job ended before it could be cancelled"
        seen.append(status)
        time.sleep(0.02)
    running = [s for s in seen if s.state == JobState.RUNNING]
    assert all((s.rows.total, s.shards.total) == (48, 24) for s in running)
    assert running[-1].rows.pending == 48 - running[-1].rows.succeeded - running[-1].rows.failed

    cancelled = deployment.client.jobs.cancel(job.job_id)
    assert cancelled.state == JobState.CANCELLED
    done_at_cancel = cancelled.shards.done

    # Wait until the worker has taken every shard off the queue and runs none of them.
    while deployment.repository.redis.llen(f"{QUEUE_PREFIX}tiny") or worker_busy(deployment):
        assert time.monotonic() < deadline, "the worker never went idle"
        time.sleep(0.1)
    final = deployment.client.jobs.get(job.job_id)
    assert final.state == JobState.CANCELLED
    assert final.shards.done <= done_at_cancel + 2 < final.shards.total  # at most those in hand finished
    assert not deployment.repository.store.exists(deployment.repository.layout(job.job_id).manifest_key)


def worker_busy(deployment: Deployment) -> bool:
    from celery import Celery

    app = Celery(broker=deployment.broker_url)
    try:
        active = app.control.inspect(timeout=1).active() or {}
    finally:
        app.close()
    return any(active.values())
