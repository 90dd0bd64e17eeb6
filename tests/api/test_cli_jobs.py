"""`bulkinfer submit | status | list | cancel | results | wait` as real processes against a live
deployment: output, --json, and the exit code of each job outcome (see tests/api/live_stack.py)."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import select
import signal
import subprocess
import sys
from collections.abc import Iterator

import pyarrow.parquet as pq
import pytest

from bulkinfer.api.cli.jobs import (
    EXIT_CANCELLED,
    EXIT_ERROR,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_NOT_FINISHED,
    EXIT_ROWS_FAILED,
    EXIT_SUCCEEDED,
    EXIT_TIMEOUT,
)
from bulkinfer.api.client import JobState
from tests.api.live_stack import LiveStack, live_stack
from tests.fixtures.services import REPO_ROOT, free_port, wait_until

pytestmark = pytest.mark.timeout(300)

ROWS = [{"id": f"q{n}", "q": q} for n, q in enumerate(["def add(a, b):", "import sys", "class Point:"])]
ROWS.append({"id": "no-q"})  # fails: the template needs q


@pytest.fixture(scope="module")
def stack(redis_server, s3_server, tiny_checkpoint, tmp_path_factory) -> Iterator[LiveStack]:
    with live_stack(redis_server, s3_server, tiny_checkpoint, tmp_path_factory.mktemp("model-cache")) as live:
        yield live


def cli(stack: LiveStack, *args: str, **env: str) -> subprocess.CompletedProcess:
    """`bulkinfer ARGS` in a child process; the API URL comes from $BULKINFER_API_URL."""
    return subprocess.run([sys.executable, "-m", "bulkinfer.api.cli", *map(str, args)], cwd=REPO_ROOT,
                          env=stack.cli_env(**{"BULKINFER_API_URL": stack.url, **env}), capture_output=True,
                          text=True, timeout=180)


def rows_file(tmp_path) -> str:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    return str(path)


def test_a_succeeded_job_submit_wait_status_results_and_list(stack, tmp_path) -> None:
    submitted = cli(stack, "submit", rows_file(tmp_path), "--model", "tiny", "--template", "Q: {q}",
                    "--instructions", "Answer briefly.", "--id-column", "id", "--max-tokens", "4",
                    "--temperature", "0", "--shard-size", "2", "--metadata", "team=cli", "--wait",
                    "--poll-interval", "0.2", "--json")
    assert submitted.returncode == EXIT_SUCCEEDED, submitted.stderr
    final = json.loads(submitted.stdout)
    job_id = final["job_id"]
    assert final["state"] == "succeeded" and (final["rows"]["total"], final["rows"]["failed"]) == (4, 1)
    spec = stack.client.jobs.spec(job_id)
    assert (spec.template, spec.instructions, spec.id_column, spec.metadata) == (
        "Q: {q}", "Answer briefly.", "id", {"team": "cli"})
    assert (spec.sampling.max_tokens, spec.sampling.temperature) == (4, 0)

    status = cli(stack, "status", job_id)
    assert status.returncode == EXIT_SUCCEEDED and "state     succeeded" in status.stdout
    assert "rows      4/4 done (3 succeeded, 1 failed)" in status.stdout
    assert cli(stack, "status", job_id, "--strict").returncode == EXIT_ROWS_FAILED  # failed rows count
    waited = cli(stack, "wait", job_id, "--strict", "--json")
    assert waited.returncode == EXIT_ROWS_FAILED and json.loads(waited.stdout)["job_id"] == job_id
    assert cli(stack, "wait", job_id).returncode == EXIT_SUCCEEDED

    results = cli(stack, "results", job_id)
    assert results.returncode == EXIT_SUCCEEDED
    rows = [json.loads(line) for line in results.stdout.splitlines()]
    assert rows == list(stack.client.jobs.results(job_id))
    assert [row["id"] for row in rows] == ["q0", "q1", "q2", "no-q"]
    # `bulkinfer results ID | head`: a reader that went away is not an error.
    read_end, write_end = os.pipe()
    os.close(read_end)
    piped = subprocess.run([sys.executable, "-m", "bulkinfer.api.cli", "results", job_id], cwd=REPO_ROOT,
                           env=stack.cli_env(BULKINFER_API_URL=stack.url), stdout=write_end,
                           stderr=subprocess.PIPE, text=True, timeout=180)
    os.close(write_end)
    assert (piped.returncode, piped.stderr) == (EXIT_SUCCEEDED, "")
    out = tmp_path / "out.parquet"
    saved = cli(stack, "results", job_id, "-o", out, "--json")
    assert saved.returncode == EXIT_SUCCEEDED
    assert json.loads(saved.stdout) == {"job_id": job_id, "path": str(out), "rows": 4,
                                        "output_format": "jsonl"}
    assert pq.read_table(out).column("id").to_pylist() == ["q0", "q1", "q2", "no-q"]

    listed = cli(stack, "list", "--json", "--status", "succeeded")
    assert listed.returncode == EXIT_SUCCEEDED
    assert job_id in [job["job_id"] for job in json.loads(listed.stdout)]
    dead = f"http://127.0.0.1:{free_port()}"
    table = cli(stack, "list", "--api-url", stack.url, BULKINFER_API_URL=dead)  # the flag wins over the env
    assert table.returncode == EXIT_SUCCEEDED and job_id in table.stdout and "succeeded" in table.stdout


def test_failed_cancelled_and_timed_out_jobs_exit_with_their_own_codes(stack) -> None:
    uri = stack.put_input("rows.jsonl", "".join(json.dumps(row) + "\n" for row in ROWS[:3]).encode())
    failed = cli(stack, "submit", uri, "--model", "retired", "--prompt-column", "q", "--wait",
                 "--poll-interval", "0.2", "--json")
    assert failed.returncode == EXIT_FAILED, failed.stderr
    assert json.loads(failed.stdout)["state"] == "failed" and "retired" in json.loads(failed.stdout)["error"]

    timed_out = cli(stack, "submit", uri, "--model", "small", "--prompt-column", "q", "--wait",
                    "--timeout", "1", "--poll-interval", "0.2", "--json")
    assert timed_out.returncode == EXIT_TIMEOUT, timed_out.stderr
    stuck = json.loads(timed_out.stdout)
    assert stuck["timed_out"] is True and stuck["state"] in ("queued", "running")
    assert "is still" in timed_out.stderr
    job_id = stuck["job_id"]
    assert cli(stack, "status", job_id).returncode == EXIT_NOT_FINISHED
    assert cli(stack, "wait", job_id, "--timeout", "0.5", "--poll-interval", "0.1").returncode == EXIT_TIMEOUT

    cancelled = cli(stack, "cancel", job_id)
    assert cancelled.returncode == EXIT_SUCCEEDED and "state     cancelled" in cancelled.stdout
    assert cli(stack, "cancel", job_id).returncode == EXIT_SUCCEEDED  # again: no change
    assert cli(stack, "wait", job_id).returncode == EXIT_CANCELLED
    status = cli(stack, "status", job_id, "--json")
    assert status.returncode == EXIT_CANCELLED and json.loads(status.stdout)["state"] == "cancelled"
    no_results = cli(stack, "results", job_id)
    assert no_results.returncode == EXIT_ERROR and "409: job" in no_results.stderr


def test_usage_and_api_errors_exit_2_with_a_message(stack, tmp_path) -> None:
    path = rows_file(tmp_path)
    no_model = cli(stack, "submit", path, "--prompt-column", "q")
    assert no_model.returncode == EXIT_ERROR and "--model" in no_model.stderr
    both = cli(stack, "submit", path, "--model", "tiny", "--prompt-column", "q", "--template", "{q}")
    assert both.returncode == EXIT_ERROR and "not allowed with argument" in both.stderr
    missing = cli(stack, "submit", tmp_path / "nope.jsonl", "--model", "tiny", "--prompt-column", "q")
    assert missing.returncode == EXIT_ERROR and "is not a file" in missing.stderr
    unknown = cli(stack, "status", "job-nope", "--json")
    assert unknown.returncode == EXIT_ERROR and "404: no job 'job-nope'" in unknown.stderr
    assert json.loads(unknown.stdout) == {"error": "404: no job 'job-nope'"}
    bad_model = cli(stack, "submit", path, "--model", "gpt-9", "--prompt-column", "q")
    assert bad_model.returncode == EXIT_ERROR and "bulkinfer submit: 400:" in bad_model.stderr
    unreachable = cli(stack, "list", "--api-url", f"http://127.0.0.1:{free_port()}")
    assert unreachable.returncode == EXIT_ERROR and "cannot reach the API at" in unreachable.stderr
    assert cli(stack, "wait", "--help").returncode == 0


def test_submit_with_an_idempotency_key_is_the_same_job_and_another_spec_is_refused(stack, tmp_path) -> None:
    path = rows_file(tmp_path)
    args = ["submit", path, "--model", "small", "--template", "{q}", "--idempotency-key", "cli-1", "--json"]
    first, again = cli(stack, *args), cli(stack, *args)
    assert first.returncode == again.returncode == EXIT_SUCCEEDED, first.stderr
    assert json.loads(first.stdout)["job_id"] == json.loads(again.stdout)["job_id"]
    other = cli(stack, *args[:-1], "--max-tokens", "9")
    assert other.returncode == EXIT_ERROR
    assert "409: idempotency key 'cli-1' was already used for job" in other.stderr
    stack.client.jobs.cancel(json.loads(first.stdout)["job_id"])


def test_wait_draws_progress_on_a_terminal_only_and_ctrl_c_leaves_the_job_running(stack) -> None:
    uri = stack.put_input("three.jsonl", "".join(json.dumps(row) + "\n" for row in ROWS[:3]).encode())
    job = stack.client.jobs.create(uri, model="small", prompt_column="q")
    # Waits on conditions, generous: a loaded 2-core machine once took over 60 s to get here.
    wait_until(lambda: stack.client.jobs.get(job).rows.total == 3, timeout=180, what="the job to be planned")

    command = [sys.executable, "-m", "bulkinfer.api.cli", "wait", job.job_id, "--poll-interval", "0.1"]
    env = stack.cli_env(BULKINFER_API_URL=stack.url, COLUMNS="160")
    controller, terminal = pty.openpty()
    # As from a terminal's shell: Ctrl-C not ignored, whatever this process inherited (a suite started
    # in the background, e.g. `nohup make test &`, ignores SIGINT, and a child would inherit that).
    process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=terminal,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    os.close(terminal)
    screen = bytearray()

    def read_screen() -> None:
        if select.select([controller], [], [], 0.1)[0]:
            with contextlib.suppress(OSError):  # EIO once the process has closed its end
                screen.extend(os.read(controller, 4096))

    def bar_drawn() -> bool:
        read_screen()
        return b"0/3 rows" in screen

    def stopped() -> bool:  # the terminal is read on meanwhile: a full one would block the bar's writes
        read_screen()
        return process.poll() is not None

    try:
        wait_until(bar_drawn, timeout=180, what="the progress bar")
        process.send_signal(signal.SIGINT)
        wait_until(stopped, timeout=60, what="wait to stop on Ctrl-C")
        assert process.returncode == EXIT_INTERRUPTED
    finally:
        if process.poll() is None:
            process.kill()
        os.close(controller)
        process.stdout.close()
    assert f"{job.job_id} running" in screen.decode()
    assert stack.client.jobs.get(job).state == JobState.RUNNING  # Ctrl-C does not cancel

    piped = cli(stack, "wait", job.job_id, "--timeout", "0.5", "--poll-interval", "0.1")
    assert piped.returncode == EXIT_TIMEOUT and "rows" not in piped.stderr  # no bar in a pipe
    assert stack.client.jobs.cancel(job).state == JobState.CANCELLED


def test_submit_takes_a_json_schema_a_webhook_and_json_options_from_files(stack, tmp_path) -> None:
    schema = {"type": "object", "properties": {"team": {"enum": ["billing", "tech"]}}, "required": ["team"]}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    (tmp_path / "spec.json").write_text(json.dumps({"sampling": {"seed": 7}, "priority": 3}))
    submitted = cli(stack, "submit", rows_file(tmp_path), "--model", "small", "--prompt-column", "q",
                    "--json-schema", f"@{tmp_path / 'schema.json'}", "--spec", f"@{tmp_path / 'spec.json'}",
                    "--webhook-url", "https://hooks.example.com/bulkinfer", "--json")
    assert submitted.returncode == EXIT_SUCCEEDED, submitted.stderr
    spec = stack.client.jobs.spec(json.loads(submitted.stdout)["job_id"])
    assert spec.response_format.model_dump(by_alias=True, exclude_none=True) == {
        "type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
    assert spec.webhook_url == "https://hooks.example.com/bulkinfer"
    assert (spec.sampling.seed, spec.priority) == (7, 3)

    as_object = cli(stack, "submit", rows_file(tmp_path), "--model", "small", "--prompt-column", "q",
                    "--json-object", "--json")
    assert as_object.returncode == EXIT_SUCCEEDED, as_object.stderr
    object_spec = stack.client.jobs.spec(json.loads(as_object.stdout)["job_id"])
    assert object_spec.response_format.type == "json_object"

    missing = cli(stack, "submit", rows_file(tmp_path), "--model", "small", "--prompt-column", "q",
                  "--json-schema", f"@{tmp_path / 'nope.json'}")
    assert missing.returncode == EXIT_ERROR and "cannot read" in missing.stderr
    assert "nope.json" in missing.stderr
    both = cli(stack, "submit", rows_file(tmp_path), "--model", "small", "--prompt-column", "q",
               "--json-object", "--json-schema", "{}")
    assert both.returncode == EXIT_ERROR and "not allowed with argument" in both.stderr
