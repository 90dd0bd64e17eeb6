"""Published batch code gets what it meant, on the real instruct model (SmolLM2-135M-Instruct) through
`bulkinfer run`: lines without `max_tokens` get the whole answer, and plain rows with instructions go
through the model's chat template as chat lines do."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bulkinfer.worker.run.run_cli import run_cli

pytestmark = pytest.mark.timeout(300)

INSTRUCTIONS = "You are a film critic. Answer in one short sentence."
MOVIES = ["Two imprisoned men bond over a number of years.",
          "An aging crime boss hands his empire to his reluctant son."]


def _run(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, str, str]:
    saved = dict(os.environ)
    try:
        code = run_cli([str(arg) for arg in argv] + ["--no-progress", "--dtype", "float32"])
    finally:  # run exports its settings into the environment: they must not reach later tests
        os.environ.clear()
        os.environ.update(saved)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _chat_line(custom_id: str, content: str, **body: object) -> dict:
    """The OpenAI batch guide's line: a chat request with no max_tokens unless given."""
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": content}], **body}}


def test_chat_lines_without_max_tokens_get_the_whole_answer_and_the_cap_is_named(
        real_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    batch = tmp_path / "batch.jsonl"
    batch.write_text("".join(json.dumps(line) + "\n" for line in [
        _chat_line("paris", "Write two short sentences about Paris.", temperature=0),
        _chat_line("too-long", "Write a novel.", max_tokens=500)]))
    out = tmp_path / "out.jsonl"
    code, _, stderr = _run(capsys, batch, "-o", out, "--model", real_model, "--max-tokens-cap", "200")
    assert code == 0, stderr
    paris, too_long = _lines(out)
    body = paris["response"]["body"]
    # Past the engine's offline default of 16 tokens, to the model's own end of the answer.
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] > 16
    assert body["choices"][0]["message"]["content"].rstrip().endswith(".")
    assert too_long["response"] is None and too_long["error"]["code"] == "invalid_sampling"
    message = too_long["error"]["message"]
    assert "max_tokens 500 is more than this deployment's max_tokens_cap (200)" in message


def test_plain_rows_with_instructions_run_through_the_chat_template(
        real_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The README's quick start (prompt_column + instructions) on an instruct model: each row is the
    user's turn under the instructions as the system message (token for token what chat rows get:
    tests/worker/test_prompts.py), so the model answers instead of continuing a raw prompt."""
    plain = tmp_path / "movies.jsonl"
    plain.write_text("".join(json.dumps({"id": f"m{n}", "description": text}) + "\n"
                             for n, text in enumerate(MOVIES)))
    code, stdout, stderr = _run(capsys, plain, "-o", tmp_path / "out.jsonl", "--prompt-column", "description",
                                "--instructions", INSTRUCTIONS, "--model", real_model, "--id-column", "id",
                                "--temperature", "0", "--max-tokens", "24")
    assert code == 0, stderr
    assert "prompts rendered as: chat_template" in stdout
    rows = _lines(tmp_path / "out.jsonl")
    assert all(row["error"] is None and row["text"].strip() not in ("", "{}") for row in rows)
    # Rendered as a conversation: the template's markers around the instructions and the row.
    assert all(row["usage"]["prompt_tokens"] > 20 for row in rows)
