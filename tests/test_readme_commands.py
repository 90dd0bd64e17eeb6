"""Every command in README.md's shell blocks runs as written (issue 55), or is listed here with the
reason it is left out (S3, a real model download, a webhook, a model the reader has): the two lists
together are the README's commands, so a command added to the README fails this test until it runs
or says why not.

The commands run in README order through `bash -e`, in a folder holding the files they name, with
`bulkinfer` and `.venv/bin/bulkinfer` standing for this checkout's CLI. One `bulkinfer up` (the
README's own, started first and stopped with Ctrl-C at the end) serves the job commands. What this
test changes is where, not what: the stack's port (free, where the README says 8000, through
BULKINFER_API_PORT / BULKINFER_API_URL and the curl URLs), JOB_ID and RETRY_ID (the jobs the
commands before made), and what keeps the `small` preset quick: a short context (a random-weight
model rarely stops on its own) and one torch thread per process (on a busy 2-core machine, two
threads per engine waiting on each other made each step 6x slower). Before reading a job's results
it waits for the job to end, as a reader would. `pytest -s` prints what each command took.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bulkinfer.api.client import Client
from tests.fixtures.services import REPO_ROOT, free_port

pytestmark = pytest.mark.timeout(900)

README = REPO_ROOT / "README.md"
SHELL_BLOCK = re.compile(r"^```(?:bash|sh|shell)\n(.*?)^```", re.M | re.S)
COMMENT = re.compile(r"\s{2,}#.*$")  # the README's comments follow a command after two spaces or more
JOB_ID = re.compile(r"job-[0-9a-f]{16,}")
COMMAND_TIMEOUT_S = 300
STACK_START_TIMEOUT_S = 240

UP = ".venv/bin/bulkinfer up"
# The README commands this test runs, in the order the README has them, each with its exit code and
# a text its output holds.
RUN: dict[str, tuple[int, str]] = {
    ".venv/bin/bulkinfer demo --offline --preset tiny --rows 16": (0, "rows: 16 (0 errors)"),
    UP: (0, "stopped"),
    'curl -s http://127.0.0.1:8000/jobs -F \'spec={"model": "small", "prompt_column": "q", "instructions": '
    '"Answer briefly.", "sampling": {"max_tokens": 64}}\' -F file=@rows.jsonl': (0, '"job_id"'),
    "curl -s http://127.0.0.1:8000/jobs/JOB_ID": (0, '"state":'),
    "curl -s 'http://127.0.0.1:8000/jobs/JOB_ID/results?download=true'": (0, '"finish_reason"'),
    "bulkinfer submit rows.jsonl --model small --template 'Q: {q}' --instructions 'Answer briefly.' --wait":
        (0, "state     succeeded"),
    "bulkinfer submit tickets.jsonl --model small --prompt-column ticket --json-schema @triage.schema.json "
    "--wait": (0, "state     succeeded"),
    "bulkinfer status JOB_ID; bulkinfer list --status running; bulkinfer wait JOB_ID --timeout 600":
        (0, "state     succeeded"),
    # A finished job cannot be cancelled: 409, exit code 2, as docs/sdk-and-cli.md says.
    "bulkinfer results JOB_ID -o out.parquet; bulkinfer cancel JOB_ID": (2, "nothing to cancel"),
    "bulkinfer results JOB_ID --partial > first.jsonl": (0, ""),
    "bulkinfer retry JOB_ID --wait; bulkinfer results RETRY_ID --merged -o all.jsonl": (0, "merged"),
    '.venv/bin/bulkinfer run tickets.parquet -o answers.parquet --model small --instructions "Triage the '
    'ticket." --template "Ticket: {ticket}\\nAnswer:" --id-column id --temperature 0 --max-tokens 64':
        (0, "rows: 2 in answers.parquet"),
    'curl -s localhost:8000/models': (0, '"small"'),
    ".venv/bin/bulkinfer models list": (0, "presets"),
}
LEFT_OUT: dict[str, str] = {
    "make demo": "fetches SmolLM2 from PyPI and serves it: tests/api/test_stack.py runs `bulkinfer demo` so",
    "make test": "the whole test suite, this test among it",
    ".venv/bin/bulkinfer up --model smollm2-135m-instruct --port 0 --home /tmp/bi":
        "fetches SmolLM2 from PyPI; `up --model` is tests/api/test_stack.py's",
    "bulkinfer submit s3://bucket/rows.parquet --model small --prompt-column q --output s3://bucket/out/ "
    "--json": "needs S3 (tests/api/test_cli_jobs.py submits s3:// inputs to moto)",
    ".venv/bin/bulkinfer run batch.jsonl -o results.jsonl --model /srv/models/qwen3-8b":
        "names the reader's own 8B model (tests/worker/test_run_file.py runs OpenAI batch files)",
    "bulkinfer schedule create --cron '*/10 * * * *' --input-prefix 's3://bucket/incoming/*.jsonl' --model "
    "small --prompt-column q --webhook-url https://example.com/hooks/bulkinfer":
        "needs S3 and a webhook receiver (tests/api/test_schedules_live.py)",
    "bulkinfer schedule list | get ID | pause ID | resume ID | delete ID | tick ID | jobs ID":
        "a list of subcommands, not one command line",
    "bulkinfer up --model smollm2-135m-instruct --lora sql=s3://bucket/adapters/sql --lora "
    "fr=/srv/adapters/fr": "needs S3, SmolLM2 from PyPI and the reader's adapters (test_lora_live.py)",
    "(echo photo; aws s3 ls s3://shop/photos/ | awk '{print \"s3://shop/photos/\" $4}') > photos.csv":
        "lists the reader's S3 folder with the AWS CLI (tests/api/test_images_live.py reads s3:// images)",
    "bulkinfer submit photos.csv --model smolvlm-256m --id-column photo --image-column photo --template "
    "'Write a one-line catalog caption.' --max-tokens 48 --wait":
        "names the reader's vision-language model (tests/api/test_images_live.py runs image_column jobs)",
}
# What the small preset runs in: a context short enough that every row ends within a few dozen steps.
ENGINE_OPTIONS = {"max_model_len": 64, "num_kv_blocks": 32, "max_num_seqs": 8}


def readme_commands() -> list[tuple[str, str]]:
    """(key, text) of each command in README.md's shell blocks, in order: the text as written (a line
    ending in `\\`, or an open quote, goes on), the key the same without comments, on one line."""
    commands = []
    for block in SHELL_BLOCK.findall(README.read_text()):
        pending: list[str] = []
        for line in block.splitlines():
            if not pending and not line.strip():
                continue
            pending.append(line)
            text = "\n".join(pending)
            if line.endswith("\\") or not _complete(text):
                continue
            key = " ".join(COMMENT.sub("", part).rstrip("\\").strip() for part in pending)
            commands.append((" ".join(key.split()), text))
            pending = []
        assert not pending, f"an unfinished command in README.md: {pending}"
    return commands


def _steps(text: str) -> list[str]:
    """A command line's `;`-separated commands (a `;` inside quotes is text)."""
    steps, current, quote = [], "", ""
    for char in text:
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == ";":
            steps.append(current)
            current = ""
            continue
        current += char
    return [step.strip() for step in [*steps, current] if step.strip()]


def _complete(text: str) -> bool:
    try:
        shlex.split(text, comments=True)
    except ValueError:  # an open quote: the command goes on on the next line
        return False
    return True


def test_the_commands_run_or_left_out_are_the_readmes() -> None:
    keys = [key for key, _ in readme_commands()]
    assert not set(RUN) & set(LEFT_OUT)
    assert sorted(keys) == sorted([*RUN, *LEFT_OUT]), "README.md's commands and this test's lists differ"
    assert [key for key in keys if key in RUN] == list(RUN)  # run in the README's order


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """The folder the commands run in: the files they name, and the CLI where they look for it."""
    cli = f'#!/bin/sh\nexec "{sys.executable}" -m bulkinfer.api.cli "$@"\n'
    for folder in (tmp_path / "bin", tmp_path / ".venv" / "bin"):
        folder.mkdir(parents=True)
        (folder / "bulkinfer").write_text(cli)
        (folder / "bulkinfer").chmod(0o755)
    (tmp_path / "rows.jsonl").write_text('{"q": "What is 2 + 2?"}\n{"q": "Name a colour."}\n')
    tickets = [{"ticket": "The printer is jammed."}, {"ticket": "I was charged twice."}, {"id": "no-ticket"}]
    (tmp_path / "tickets.jsonl").write_text("".join(json.dumps(row) + "\n" for row in tickets))
    schema = {"type": "object", "properties": {"priority": {"enum": ["low", "high"]}},
              "required": ["priority"]}
    (tmp_path / "triage.schema.json").write_text(json.dumps(schema))
    pq.write_table(pa.table({"id": ["t1", "t2"], "ticket": ["The printer is jammed.", "Refund me."]}),
                   tmp_path / "tickets.parquet")
    return tmp_path


@pytest.fixture
def environment(workdir: Path) -> dict[str, str]:
    kept = {name: value for name, value in os.environ.items()
            if not name.startswith("BULKINFER_") or name in ("BULKINFER_CACHE_DIR", "BULKINFER_MODEL_CACHE")}
    port = free_port()
    return {**kept, "PATH": f"{workdir / 'bin'}{os.pathsep}{os.environ['PATH']}",
            "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1", "BULKINFER_API_PORT": str(port),
            "BULKINFER_API_URL": f"http://127.0.0.1:{port}", "BULKINFER_DTYPE": "float32",
            "BULKINFER_ENGINE_OPTIONS": json.dumps(ENGINE_OPTIONS), "OMP_NUM_THREADS": "1"}


class Session:
    """The commands' shell: their folder and environment, the stack `up` serves, the jobs they made."""

    def __init__(self, workdir: Path, env: dict[str, str]) -> None:
        self.workdir = workdir
        self.env = env
        self.url = env["BULKINFER_API_URL"]
        self.ids: dict[str, str] = {}  # JOB_ID, RETRY_ID → the job each stands for
        self.up: subprocess.Popen[str] | None = None

    def text(self, command: str) -> str:
        """The command with the stack's address and the jobs' ids in."""
        command = command.replace("127.0.0.1:8000", self.url.removeprefix("http://"))
        command = command.replace("localhost:8000", self.url.removeprefix("http://"))
        for name, job_id in self.ids.items():
            command = re.sub(rf"\b{name}\b", job_id, command)
        return command

    def run(self, command: str) -> tuple[int, str]:
        """Each of the command's `;`-separated steps in turn, until one fails (as `bash -e` would):
        a step may name the job the one before made (`retry JOB_ID; results RETRY_ID`)."""
        code, output = 0, ""
        for step in _steps("\n".join(COMMENT.sub("", line) for line in command.splitlines())):
            if "results" in step and "JOB_ID" in self.ids:  # a reader waits for a job before its rows
                with Client(self.url, timeout=30) as client:
                    client.jobs.wait(self.ids["JOB_ID"], timeout=COMMAND_TIMEOUT_S, progress=False)
            done = subprocess.run(["bash", "-e", "-c", self.text(step)], cwd=self.workdir, env=self.env,
                                  capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
            code, output = done.returncode, output + done.stdout + done.stderr
            self._remember_ids(step, done.stdout + done.stderr)
            if code != 0:
                break
        return code, output

    def _remember_ids(self, step: str, output: str) -> None:
        found = JOB_ID.findall(output)
        if found and ("submit" in step or "/jobs -F" in step):
            self.ids["JOB_ID"] = found[-1]
        if found and " retry " in f" {step} ":
            self.ids["RETRY_ID"] = next(job for job in found if job != self.ids["JOB_ID"])

    def start_up(self, command: str) -> None:
        self.up = subprocess.Popen(["bash", "-c", self.text(command)], cwd=self.workdir, env=self.env,
                                   text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        lines: list[str] = []
        deadline = time.monotonic() + STACK_START_TIMEOUT_S
        while not any("Ctrl-C to stop" in line for line in lines):
            started = time.monotonic() < deadline and self.up.poll() is None
            assert started, f"`{UP}` did not start:\n{''.join(lines)}"
            lines.append(self.up.stdout.readline())

    def stop_up(self) -> tuple[int, str]:
        """Ctrl-C, as the README says."""
        assert self.up is not None
        os.killpg(self.up.pid, signal.SIGINT)
        rest, _ = self.up.communicate(timeout=120)
        return self.up.returncode, rest

    def kill_up(self) -> None:
        if self.up is not None and self.up.poll() is None:
            os.killpg(self.up.pid, signal.SIGKILL)
            self.up.wait(30)


@pytest.fixture
def session(workdir: Path, environment: dict[str, str]) -> Iterator[Session]:
    shell = Session(workdir, environment)
    try:
        yield shell
    finally:
        shell.kill_up()


def test_every_readme_command_that_needs_no_outside_service_runs_as_written(session: Session) -> None:
    for key, command in readme_commands():
        if key not in RUN:
            continue
        started = time.monotonic()
        if key == UP:
            session.start_up(command)
            print(f"{time.monotonic() - started:6.1f}s  {key}", flush=True)  # pytest -s shows what each costs
            continue
        code, output = session.run(command)
        expected_code, expected_text = RUN[key]
        assert code == expected_code and expected_text in output, f"{command}\nexit code {code}:\n{output}"
        print(f"{time.monotonic() - started:6.1f}s  {key}", flush=True)
    code, output = session.stop_up()
    assert (code, RUN[UP][1] in output) == (RUN[UP][0], True), output
    answers = pq.read_table(session.workdir / "answers.parquet").to_pylist()
    assert [(row["id"], row["error"]) for row in answers] == [("t1", None), ("t2", None)]
    assert pq.read_table(session.workdir / "out.parquet").num_rows == 3
    assert len((session.workdir / "all.jsonl").read_text().splitlines()) == 3  # every row once, merged
