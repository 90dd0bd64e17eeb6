"""`bulkinfer run`: a file through the engine with no servers, every row once in the output, and a
run killed mid-file resumed without losing, repeating or recomputing a row.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest

from bulkinfer.jobs.formats.output import OutputRow
from bulkinfer.jobs.spec import JobSpec
from bulkinfer.worker.run.run_cli import run_cli
from bulkinfer.worker.run.run_output import AlreadyComplete, OutputConflict, open_output, work_dir_for
from tests.fixtures.services import REPO_ROOT, ServiceDied, wait_until

pytestmark = pytest.mark.timeout(300)


def _write_jsonl(path: Path, records: list[dict | str]) -> Path:
    path.write_text("".join((record if isinstance(record, str) else json.dumps(record)) + "\n"
                            for record in records))
    return path


def _run(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, str, str]:
    saved = dict(os.environ)
    try:
        code = run_cli([str(arg) for arg in argv] + ["--no-progress"])
    finally:  # run exports its settings into the environment: they must not reach later tests
        os.environ.clear()
        os.environ.update(saved)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_jsonl_in_and_out_every_row_once_with_errors_in_place(tiny_checkpoint: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    records: list[dict | str] = [{"id": f"r{i}", "ticket": f"printer {i} is jammed"} for i in range(10)]
    records.insert(4, "{not json")  # a bad line is a row too: its error goes to the output, in place
    records.insert(7, {"id": "no-ticket"})  # the template's column is missing
    source = _write_jsonl(tmp_path / "in.jsonl", records)
    out = tmp_path / "out.jsonl"
    code, stdout, stderr = _run(capsys, source, "-o", out, "--model", tiny_checkpoint, "--template",
                                "Ticket: {ticket}", "--id-column", "id", "--instructions", "Triage it.",
                                "--max-tokens", "4", "--temperature", "0", "--batch-size", "3",
                                "--dtype", "float32")
    assert code == 0, stderr
    assert "dtype float32 (float32 requested)" in stdout  # the summary says what ran and why
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 12
    assert [line["id"] for line in lines if line["error"] is None] == [f"r{i}" for i in range(10)]
    assert lines[4]["error"]["code"] == "invalid_json" and lines[7]["error"]["code"] == "missing_column"
    assert all(line["usage"]["completion_tokens"] == 4 for line in lines if line["error"] is None)
    assert "12 in" in stdout and "2 failed" in stdout
    assert not (work_dir_for(out) / "parts").exists()  # only the finished record stays

    # The same command again is a no-op that succeeds (make, a cron retry); other options are refused.
    before = out.read_bytes()
    argv = [source, "-o", out, "--model", tiny_checkpoint, "--template", "Ticket: {ticket}", "--id-column",
            "id", "--instructions", "Triage it.", "--max-tokens", "4", "--temperature", "0",
            "--batch-size", "3", "--dtype", "float32"]
    code, stdout, stderr = _run(capsys, *argv)
    assert code == 0 and "already complete: 12 rows (2 failed)" in stdout and out.read_bytes() == before
    code, _, stderr = _run(capsys, source, "-o", out, "--model", tiny_checkpoint, "--template", "{ticket}")
    assert code == 1 and "output of another run" in stderr and out.read_bytes() == before
    with out.open("a") as edited:  # OUT changed since the run finished: left alone, not re-declared done
        edited.write("\n")
    code, _, stderr = _run(capsys, *argv)
    assert code == 1 and "changed or went away since this run finished" in stderr
    code, _, stderr = _run(capsys, source, "-o", out, "--model", tiny_checkpoint, "--template", "{ticket}",
                           "--max-tokens", "2", "--overwrite")
    assert code == 0, stderr
    assert len(out.read_text().splitlines()) == 12


def test_a_spec_with_flags_over_it_n_samples_and_logprobs(tiny_checkpoint: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    source = _write_jsonl(tmp_path / "in.jsonl", [{"ticket": f"printer {i}"} for i in range(3)])
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"template": "Ticket: {ticket}", "sampling": {"max_tokens": 9, "seed": 1}}))
    out = tmp_path / "out.jsonl"
    code, _, stderr = _run(capsys, source, "-o", out, "--model", tiny_checkpoint, "--spec", f"@{spec}",
                           "--max-tokens", "3", "--n", "2", "--logprobs", "1")
    assert code == 0, stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["id"] for line in lines] == ["0", "24", "48"]  # no id column: as jobs, the line's offset
    for line in lines:
        assert len(line["choices"]) == 2 and line["usage"]["completion_tokens"] == 6  # the flag beat the spec
        assert all(len(choice["logprobs"]) == 3 for choice in line["choices"])


def test_parquet_in_and_out_with_passthrough(tiny_checkpoint: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "in.parquet"
    table = pa.table({"id": [f"p{i}" for i in range(9)], "question": [f"what is {i}?" for i in range(9)],
                      "team": ["a", "b", "c"] * 3})
    pq.write_table(table, source, row_group_size=4)
    out = tmp_path / "answers.parquet"
    code, stdout, stderr = _run(capsys, source, "-o", out, "--model", tiny_checkpoint, "--prompt-column",
                                "question", "--id-column", "id", "--passthrough", "team", "--max-tokens", "3",
                                "--batch-size", "4")
    assert code == 0, stderr
    result = pq.read_table(out)
    assert result.column("id").to_pylist() == [f"p{i}" for i in range(9)]
    assert result.column("team").to_pylist() == ["a", "b", "c"] * 3
    assert result.column("completion_tokens").to_pylist() == [3] * 9
    assert result.column("error").null_count == 9
    assert not (work_dir_for(out) / "parts").exists()


def test_csv_in_and_out_under_one_header_with_errors_in_place(tiny_checkpoint: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    text = io.StringIO()
    cells = [[f"0{i}", f"what is {i},\nreally?", "a" if i % 2 else ""] for i in range(5)]
    csv.writer(text).writerows([["id", "question", "team"], *cells])
    source = tmp_path / "in.csv"
    source.write_bytes(text.getvalue().encode() + b"x,a row,with,four fields\r\n")
    out = tmp_path / "answers.csv"
    code, _, stderr = _run(capsys, source, "-o", out, "--model", tiny_checkpoint, "--prompt-column",
                           "question", "--id-column", "id", "--passthrough", "team", "--max-tokens", "3",
                           "--batch-size", "2")
    assert code == 0, stderr
    assert out.read_bytes().count(b'"id"') == 1  # three batches appended under one header row
    result = pa_csv.read_csv(out, parse_options=pa_csv.ParseOptions(newlines_in_values=True),
                             convert_options=pa_csv.ConvertOptions(column_types={"id": pa.string()},
                                                                   strings_can_be_null=True))
    # reasoning: the rows run as chat, where a thinking model's thinking comes apart (none here)
    assert result.column_names[:4] == ["id", "text", "reasoning", "finish_reason"]
    assert result.column_names[-1] == "team" and result.column("reasoning").null_count == 6
    assert result.column("id").to_pylist() == ["00", "01", "02", "03", "04", "5"]
    assert result.column("team").to_pylist() == [None, "a", None, "a", None, None]
    assert result.column("completion_tokens").to_pylist() == [3] * 5 + [None]
    assert result.column("error_code").to_pylist() == [None] * 5 + ["invalid_row"]


def test_openai_batch_in_and_out(tiny_checkpoint: Path, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    lines: list[dict | str] = [
        {"custom_id": "chat-1", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "gpt-x", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}},
        {"custom_id": "text-1", "method": "POST", "url": "/v1/completions",
         "body": {"model": "gpt-x", "prompt": "Once upon", "max_tokens": 2}},
        {"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}},
        {"custom_id": "chat-1", "method": "POST", "url": "/v1/completions", "body": {"prompt": "again"}},
    ]
    source = _write_jsonl(tmp_path / "batch.jsonl", lines)
    out = tmp_path / "results.jsonl"
    # The task given, a line of the other kind is that line's error (without it the file is refused).
    code, _, stderr = _run(capsys, source, "-o", out, "--model", tiny_checkpoint, "--temperature", "0",
                           "--batch-size", "2", "--task", "generate")
    assert code == 0, stderr
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [result["custom_id"] for result in results] == ["chat-1", "text-1", "bad-url", "chat-1"]
    chat, text, bad_url, duplicate = results
    assert chat["response"]["body"]["object"] == "chat.completion"
    assert chat["response"]["body"]["usage"]["completion_tokens"] == 3
    assert text["response"]["body"]["object"] == "text_completion"
    assert text["response"]["body"]["usage"]["completion_tokens"] == 2
    assert bad_url["error"]["code"] == "unsupported_url"
    # Duplicates are caught across the whole file, not within one batch only.
    assert duplicate["error"]["code"] == "duplicate_custom_id"


def test_a_run_offers_tools_in_the_format_its_settings_give_the_model(
        tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--tool-call-formats` with one entry gives the run's model its format (tiny's template has
    none): a forced call comes back as OpenAI's tool_calls, its arguments held to the schema."""
    schema = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
              "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": schema}}]
    line = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "gpt-x", "messages": [{"role": "user", "content": "Time?"}], "tools": tools,
                     "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 60,
                     "temperature": 0}}
    out = tmp_path / "results.jsonl"
    code, _, stderr = _run(capsys, _write_jsonl(tmp_path / "batch.jsonl", [line]), "-o", out, "--model",
                           tiny_checkpoint, "--tool-call-formats", '{"tiny": "hermes"}')
    assert code == 0, stderr
    [result] = [json.loads(text) for text in out.read_text().splitlines()]
    [choice] = result["response"]["body"]["choices"]
    [call] = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and call["function"]["name"] == "get_time"
    assert json.loads(call["function"]["arguments"])["zone"] in ("UTC", "CET")


def test_a_bad_model_or_mapping_is_a_usage_error(tiny_checkpoint: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    source = _write_jsonl(tmp_path / "in.jsonl", [{"q": "x"}])
    code, _, stderr = _run(capsys, source, "-o", tmp_path / "o.jsonl", "--model", "nope",
                           "--prompt-column", "q")
    assert code == 2 and "'nope' is not a registered model" in stderr and "catalog name" in stderr
    code, _, stderr = _run(capsys, source, "-o", tmp_path / "o.jsonl", "--model", tiny_checkpoint,
                           "--prompt-column", "q", "--template", "{q}")
    assert code == 2 and "give exactly one of prompt_column, messages_column or template" in stderr
    code, _, stderr = _run(capsys, source, "-o", tmp_path / "o.jsonl", "--model", tiny_checkpoint,
                           "--prompt-column", "q", "--spec", json.dumps({"parent_job_id": "job-1"}))
    assert code == 2 and "parent_job_id: set by POST /jobs/{id}/retry" in stderr
    bad_schema = {"response_format": {"type": "json_schema", "json_schema": {
        "name": "out", "schema": {"type": "object", "not": {"required": ["a"]}}}}}
    out = tmp_path / "schema.jsonl"
    code, _, stderr = _run(capsys, source, "-o", out, "--model", tiny_checkpoint, "--prompt-column", "q",
                           "--spec", json.dumps(bad_schema))
    assert code == 1 and "response_format: grammar for json_schema failed to compile" in stderr
    assert "'not' is not enforced" in stderr and not out.exists()  # refused once, before any row


def _rows(*indexes: int) -> list[OutputRow]:
    return [OutputRow(index, f"r{index}", text=f"t{index}", finish_reason="stop") for index in indexes]


@pytest.mark.parametrize("output_format", ["jsonl", "parquet"])
def test_resuming_drops_what_a_killed_run_wrote_after_its_last_record(tmp_path: Path,
                                                                      output_format: str) -> None:
    spec = JobSpec(input_uri="/in.jsonl", model="m", prompt_column="q", input_format="jsonl",
                   output_format=output_format)
    out = tmp_path / f"out.{output_format}"
    output = open_output(out, spec, "fp", job_id="local-x", created=1)
    output.append(_rows(0, 1))
    output.append(_rows(2))
    # A kill after writing a batch but before recording it, and a torn line / an unlisted part.
    parts = work_dir_for(out) / "parts"
    if output_format == "jsonl":
        with open(out, "ab") as file:
            file.write(b'{"id":"r3","text":"t3"}\n{"id":"r4","te')
    else:
        pq.write_table(pa.table({"id": ["r3"]}), parts / "part-000002.parquet")

    with pytest.raises(OutputConflict, match="the output of another run"):
        open_output(out, spec, "other-fingerprint", job_id="local-x", created=2)
    resumed = open_output(out, spec, "fp", job_id="local-x", created=2)
    assert resumed.progress.rows_done == 3 and resumed.progress.created == 1
    resumed.append(_rows(3, 4))
    resumed.finish()
    if output_format == "jsonl":
        ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    else:
        ids = pq.read_table(out).column("id").to_pylist()
    assert ids == ["r0", "r1", "r2", "r3", "r4"]
    assert json.loads((work_dir_for(out) / "progress.json").read_text())["finished"]
    with pytest.raises(AlreadyComplete, match="5 rows already done"):
        open_output(out, spec, "fp", job_id="local-x", created=3)


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_a_run_killed_mid_file_resumes_without_losing_repeating_or_recomputing_rows(
        tiny_checkpoint: Path, tmp_path: Path, suffix: str) -> None:
    total = 96
    source = _write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "text": f"row {i} says hello"}
                                                  for i in range(total)])
    out = tmp_path / f"out.{suffix}"
    command = [sys.executable, "-m", "bulkinfer.api.cli", "run", str(source), "-o", str(out), "--model",
               str(tiny_checkpoint), "--prompt-column", "text", "--id-column", "id", "--max-tokens", "8",
               "--temperature", "0", "--batch-size", "4", "--no-progress"]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    progress_file = work_dir_for(out) / "progress.json"
    first = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT)

    def some_batches_recorded() -> bool:
        if first.poll() is not None:
            raise ServiceDied(f"the run ended before it was killed: {first.stdout.read().decode()[-2000:]}")
        return json.loads(progress_file.read_text())["rows_done"] >= 8

    try:
        wait_until(some_batches_recorded, timeout=240, what="two batches recorded", interval=0.01)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(30)
        first.stdout.close()
    recorded = json.loads(progress_file.read_text())["rows_done"]
    assert 8 <= recorded < total
    before = out.read_bytes() if suffix == "jsonl" else b""

    second = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert second.returncode == 0, second.stderr
    skipped = int(re.search(r"(\d+) rows already done", second.stdout).group(1))
    assert skipped == recorded  # exactly what the killed run had made durable
    assert f"({total - skipped} this run, {skipped} skipped as already done)" in second.stdout
    assert json.loads(progress_file.read_text())["finished"]
    if suffix == "parquet":
        assert pq.read_table(out).column("id").to_pylist() == [f"r{i}" for i in range(total)]
        return
    lines = out.read_text().splitlines()
    assert [json.loads(line)["id"] for line in lines] == [f"r{i}" for i in range(total)]
    # The rows done before the kill are the killed run's own bytes, not rewritten.
    kept = "".join(line + "\n" for line in lines[:skipped]).encode()
    assert before.startswith(kept)


def test_speculative_decoding_changes_no_output_and_reports_its_acceptance(
        tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--speculative-config` reaches the engine; the rows are byte-for-byte those of a run without."""
    source = _write_jsonl(tmp_path / "in.jsonl",
                          [{"id": f"r{i}", "ticket": f"printer {i} is jammed " * 3} for i in range(6)])
    argv = [source, "--model", tiny_checkpoint, "--template", "Ticket: {ticket}", "--id-column", "id",
            "--max-tokens", "24", "--temperature", "0", "--dtype", "float32", "--ignore-eos"]
    code, _, stderr = _run(capsys, *argv, "-o", tmp_path / "plain.jsonl")
    assert code == 0, stderr
    # The checkpoint as its own draft: every greedy draft is accepted.
    spec = json.dumps({"method": "draft_model", "model": str(tiny_checkpoint), "num_speculative_tokens": 3,
                       "disable_by_batch_size": 64})
    code, stdout, stderr = _run(capsys, *argv, "-o", tmp_path / "spec.jsonl", "--speculative-config", spec)
    assert code == 0, stderr
    assert "speculative decoding (draft_model):" in stdout and "100% accepted" in stdout

    def rows(name: str) -> list[dict]:
        return [{k: v for k, v in json.loads(line).items() if k not in ("created",)}
                for line in (tmp_path / name).read_text().splitlines()]

    assert rows("spec.jsonl") == rows("plain.jsonl")
    code, _, stderr = _run(capsys, *argv, "-o", tmp_path / "bad.jsonl", "--speculative-config",
                           '{"method": "medusa"}')
    assert code != 0 and "speculative_config.method must be one of" in stderr


def test_a_run_with_the_kv_store_on_saves_the_shared_prefix_and_the_next_run_loads_it(
        tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Off by default for `bulkinfer run`; `--kv-store on` saves blocks under `<kv_store_uri>/kv/`,
    and a later run (a fresh engine) loads them, with the same rows."""
    instruction = "Summarise the quarterly revenue report for the board, region by region, in order: " * 2
    rows = [{"id": f"r{i}", "q": f"{instruction}{i}"} for i in range(3)]
    source = _write_jsonl(tmp_path / "in.jsonl", rows)
    argv = [source, "--model", tiny_checkpoint, "--prompt-column", "q", "--id-column", "id",
            "--max-tokens", "6", "--temperature", "0", "--dtype", "float32",
            "--engine-options", '{"kv_store_min_tokens": 16}']
    code, stdout, stderr = _run(capsys, *argv, "-o", tmp_path / "plain.jsonl")
    assert code == 0, stderr
    assert "prefix KV store" not in stdout  # off unless asked
    store = tmp_path / "kv-store"
    tier = ["--kv-store", "on", "--kv-store-uri", store]
    code, stdout, stderr = _run(capsys, *argv, *tier, "-o", tmp_path / "first.jsonl")
    assert code == 0, stderr
    saved = int(re.search(r"prefix KV store: loaded 0 blocks .*saved (\d+) blocks", stdout).group(1))
    assert saved >= 3 and len(list((store / "kv").rglob("*"))) > saved  # blocks in their namespace folders
    code, stdout, stderr = _run(capsys, *argv, *tier, "-o", tmp_path / "second.jsonl")
    assert code == 0, stderr
    assert int(re.search(r"prefix KV store: loaded (\d+) blocks", stdout).group(1)) >= 3

    def texts(name: str) -> list[str]:
        return [json.loads(line)["text"] for line in (tmp_path / name).read_text().splitlines()]

    assert texts("second.jsonl") == texts("first.jsonl") == texts("plain.jsonl")


def test_bf16_rows_get_the_same_bits_in_a_crowd_as_copies_and_in_a_rerun_of_a_few(
        real_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 45 in bf16, through an OpenAI batch file: identical requests (deduplication off, so
    each runs) get the same text and logprobs, and requests run again on their own (a retry of
    failed rows, a rerun) get the bits they got among all of them; greedy and seeded sampling. The
    real model: the tiny one's bf16 GEMMs give the same bits at any row count even without batch
    invariance (with `--batch-invariant false` this fails on the real one)."""
    def request(n: int, question: int, seeded: bool) -> dict:
        sampling = {"temperature": 1.0, "seed": 7} if seeded else {"temperature": 0}
        return {"custom_id": f"r{n}", "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "m", "messages": [{"role": "user", "content": f"Is {question} prime?"}],
                         "max_tokens": 8, "logprobs": True, "top_logprobs": 2, **sampling}}

    crowd_rows = [request(n, n // 4, seeded=n % 2 == 1) for n in range(16)]  # r0/r2, r1/r3, ... are copies
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"deduplicate": False}))

    def run(name: str, records: list[dict], batch_size: int) -> dict[str, tuple]:
        out = tmp_path / f"{name}.jsonl"
        code, _, stderr = _run(capsys, _write_jsonl(tmp_path / f"{name}-in.jsonl", records), "-o", out,
                               "--model", real_model, "--spec", f"@{spec}", "--dtype", "bfloat16",
                               "--batch-size", str(batch_size))
        assert code == 0, stderr
        results = {}
        for line in map(json.loads, out.read_text().splitlines()):
            choice = line["response"]["body"]["choices"][0]
            results[line["custom_id"]] = (choice["message"]["content"], choice["logprobs"])
        return results

    crowd = run("crowd", crowd_rows, 16)
    for n in range(0, 16, 4):
        assert crowd[f"r{n}"] == crowd[f"r{n + 2}"] and crowd[f"r{n + 1}"] == crowd[f"r{n + 3}"]
    few = run("few", [crowd_rows[4], crowd_rows[9]], 1)
    assert few == {"r4": crowd["r4"], "r9": crowd["r9"]}


def test_a_run_captions_image_rows_within_the_image_limits_its_flags_give(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from PIL import Image

    from bulkinfer.engine.vision_checkpoints import cached_vision_checkpoint

    for name, color in (("red.png", (220, 20, 20)), ("blue.png", (20, 20, 220))):
        Image.new("RGB", (40, 30), color).save(tmp_path / name)
    red, blue = str(tmp_path / "red.png"), str(tmp_path / "blue.png")
    source = _write_jsonl(tmp_path / "in.jsonl", [
        {"q": "Colour?", "img": red}, {"q": "Both?", "img": [red, blue]}, {"q": "Text only."},
        {"q": "Colour?", "img": str(tmp_path / "missing.png")}])
    out = tmp_path / "out.jsonl"
    code, stdout, stderr = _run(capsys, source, "-o", out, "--model", cached_vision_checkpoint(),
                                "--prompt-column", "q", "--image-column", "img", "--max-tokens", "3",
                                "--temperature", "0", "--dtype", "float32", "--image-max-per-row", "1")
    assert code == 0, stderr
    one, two, text, missing = [json.loads(line) for line in out.read_text().splitlines()]
    assert one["error"] is None and one["usage"]["completion_tokens"] == 3
    assert one["usage"]["prompt_tokens"] > text["usage"]["prompt_tokens"] + 16  # the image's tokens count
    assert two["error"]["code"] == "invalid_image"
    assert "over the limit of 1 per row" in two["error"]["message"]
    assert missing["error"]["code"] == "invalid_image" and "missing.png" in missing["error"]["message"]
    assert "2 failed" in stdout
