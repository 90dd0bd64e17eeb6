"""`bulkinfer bench batch-apis`: the OpenAI and Anthropic batch APIs on a real deployment.

Starts `bulkinfer up` with SmolLM2-135M-Instruct (aliased as `gpt-4o-mini` and `claude-haiku-4-5`),
then, with the official `openai` and `anthropic` packages: the same capital-city questions as an
OpenAI batch, an Anthropic Message Batch and a plain `POST /jobs` job (wall time from submit to
done, and how many answers name the right city), a large file's upload and scan rate, a batch's
create latency, and what publishing the output file costs the first read of an ended batch.
Prints the machine it ran on; figures, not assertions.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Final, cast

import anthropic
import httpx
import openai

from bulkinfer.api.client import Client
from bulkinfer.benchmarks.engine import describe_cpu

MODEL = "smollm2-135m-instruct"
ALIASES = {"gpt-4o-mini": MODEL, "claude-haiku-4-5": MODEL}
CAPITALS = {"France": "Paris", "Japan": "Tokyo", "Italy": "Rome", "Spain": "Madrid", "Germany": "Berlin",
            "Egypt": "Cairo", "Canada": "Ottawa", "Peru": "Lima", "Kenya": "Nairobi", "Norway": "Oslo",
            "Greece": "Athens", "Poland": "Warsaw", "Cuba": "Havana", "Chile": "Santiago",
            "Austria": "Vienna", "Portugal": "Lisbon"}
CHAT: Final = "/v1/chat/completions"


def question(row: str) -> str:
    country, _, number = row.partition("-")
    return f"Question {number}: what is the capital of {country}? Answer with the city's name."


def country_rows(count: int, first: int = 0) -> list[str]:
    """`<country>-<n>` ids: the countries in turn, each question numbered (no two prompts equal, so
    no path gets another's prompts from the prefix cache)."""
    countries = list(CAPITALS)
    return [f"{countries[n % len(countries)]}-{n}" for n in range(first, first + count)]


def cpu_model() -> str:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    names = [line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")]
    return f"{names[0] if names else platform.processor()}, {os.cpu_count()} cores"


def start(home: Path, port: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "BULKINFER_MODEL_ALIASES": json.dumps(ALIASES)}
    command = [sys.executable, "-m", "bulkinfer.api.cli", "up", "--home", str(home), "--port", str(port),
               "--model", MODEL]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/workers", timeout=2).json()["workers"]:
                return process
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        if process.poll() is not None:
            output = process.stdout.read().decode() if process.stdout else ""
            raise SystemExit(f"bulkinfer up stopped: {output}")
        time.sleep(1)
    raise SystemExit("bulkinfer up did not get a worker within 600 s")


def right(answers: dict[str, str]) -> int:
    return sum(CAPITALS[row.partition("-")[0]].lower() in text.lower() for row, text in answers.items())


def openai_batch(url: str, rows: list[str]) -> tuple[float, dict[str, str], float, float]:
    sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    lines = b"".join(json.dumps({"custom_id": row, "method": "POST", "url": CHAT, "body": {
        "model": "gpt-4o-mini", "max_tokens": 16, "temperature": 0,
        "messages": [{"role": "user", "content": question(row)}]}}).encode() + b"\n" for row in rows)
    started = time.perf_counter()
    file = sdk.files.create(file=("capitals.jsonl", lines), purpose="batch")
    batch = sdk.batches.create(input_file_id=file.id, endpoint=CHAT, completion_window="24h")
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        time.sleep(0.2)
        read = time.perf_counter()
        batch = sdk.batches.retrieve(batch.id)
        first_read = time.perf_counter() - read  # the last one: the read that published the files
    wall = time.perf_counter() - started
    read = time.perf_counter()
    sdk.batches.retrieve(batch.id)
    second_read = time.perf_counter() - read
    answers = {}
    for line in sdk.files.content(str(batch.output_file_id)).text.splitlines():
        record = json.loads(line)
        answers[record["custom_id"]] = record["response"]["body"]["choices"][0]["message"]["content"]
    return wall, answers, first_read, second_read


def anthropic_batch(url: str, rows: list[str]) -> tuple[float, dict[str, str]]:
    sdk = anthropic.Anthropic(base_url=url, api_key="unused")
    started = time.perf_counter()
    # Any: the SDK's params type has no "temperature", which this server reads
    # (jobs/formats/anthropic_messages.py).
    requests: list[Any] = [{"custom_id": row, "params": {
        "model": "claude-haiku-4-5", "max_tokens": 16, "temperature": 0,
        "messages": [{"role": "user", "content": question(row)}]}} for row in rows]
    batch = sdk.messages.batches.create(requests=requests)
    while batch.processing_status != "ended":
        time.sleep(0.2)
        batch = sdk.messages.batches.retrieve(batch.id)
    wall = time.perf_counter() - started
    # The server answers each row with one text block.
    answers = {item.custom_id: cast(anthropic.types.TextBlock, item.result.message.content[0]).text
               for item in sdk.messages.batches.results(batch.id) if item.result.type == "succeeded"}
    return wall, answers


def plain_job(url: str, rows: list[str]) -> tuple[float, dict[str, str]]:
    with Client(url) as client:
        started = time.perf_counter()
        job = client.jobs.create({"model": MODEL, "id_column": "id", "messages_column": "messages",
                                  "sampling": {"max_tokens": 16, "temperature": 0}},
                                 input=[{"id": row, "messages": [{"role": "user", "content": question(row)}]}
                                        for row in rows])
        client.jobs.wait(job, poll_interval=0.2, progress=False)
        wall = time.perf_counter() - started
        answers = {row["id"]: row["text"] for row in client.jobs.results(job)}
    return wall, answers


def upload_rate(url: str, requests: int) -> tuple[float, float, float]:
    """(MB, seconds to upload and scan, seconds to create a batch from it; then cancelled)."""
    sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    messages = [{"role": "user", "content": "Summarise this row in one line. " * 8}]
    data = b"".join(json.dumps({"custom_id": f"r{n}", "method": "POST", "url": CHAT, "body": {
        "model": "gpt-4o-mini", "max_tokens": 16, "messages": messages}}).encode() + b"\n"
        for n in range(requests))
    started = time.perf_counter()
    file = sdk.files.create(file=("big.jsonl", data), purpose="batch")
    uploaded = time.perf_counter() - started
    started = time.perf_counter()
    batch = sdk.batches.create(input_file_id=file.id, endpoint=CHAT, completion_window="24h")
    created = time.perf_counter() - started
    sdk.batches.cancel(batch.id)
    return len(data) / 1e6, uploaded, created


def bench_cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bulkinfer bench batch-apis", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=8741)
    parser.add_argument("--rows", type=int, default=256, help="questions in each batch and job")
    parser.add_argument("--big-requests", type=int, default=50_000, help="requests in the upload-rate file")
    args = parser.parse_args(argv)
    print(f"machine: {cpu_model()}; {time.strftime('%Y-%m-%d')}")
    describe_cpu()
    with tempfile.TemporaryDirectory(prefix="bench-batch-apis-") as home:
        process = start(Path(home), args.port)
        url = f"http://127.0.0.1:{args.port}"
        try:
            plain_job(url, country_rows(2, first=10**6))  # warm the engine: compile-once costs out
            report(url, args.rows, args.big_requests)
        finally:
            process.terminate()
            process.wait(60)
    return 0


def report(url: str, count: int, big_requests: int) -> None:
    wall, answers, publishing, later = openai_batch(url, country_rows(count))
    print(f"openai batch     {count} rows: {wall:5.1f} s submit→completed, right {right(answers)}/{count}; "
          f"the read that published the files {publishing * 1000:.0f} ms, a later read {later * 1000:.0f} ms")
    wall, answers = anthropic_batch(url, country_rows(count, first=count))
    print(f"anthropic batch  {count} rows: {wall:5.1f} s submit→ended, right {right(answers)}/{count}")
    wall, answers = plain_job(url, country_rows(count, first=2 * count))
    print(f"POST /jobs       {count} rows: {wall:5.1f} s submit→succeeded, right {right(answers)}/{count}")
    megabytes, uploaded, created = upload_rate(url, big_requests)
    print(f"files.create     {big_requests:,} requests, {megabytes:.1f} MB: {uploaded:.2f} s "
          f"({megabytes / uploaded:.0f} MB/s, scanned as it streams); batches.create {created * 1000:.0f} ms")


if __name__ == "__main__":
    raise SystemExit(bench_cli())
