"""`bulkinfer run` with LoRA adapters: `--lora NAME=LOCATION` registers them for the run's model,
`--lora-column` picks one per row and `--adapter` the default, as a job's `lora` does."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bulkinfer.engine import LLM, LoRARequest, SamplingParams
from bulkinfer.worker.run.run_cli import run_cli
from tests.engine.lora_adapters import ATTENTION_ONLY, make_adapter

PROMPTS = ["def add(a, b):", "The capital of France is"]


def test_run_picks_each_rows_adapter_by_column_and_the_default_by_flag(
        tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sql = make_adapter(tiny_checkpoint, seed=41)[0]
    fr = make_adapter(tiny_checkpoint, seed=42, targets=ATTENTION_ONLY)[0]
    rows = [{"q": prompt, "adapter": lora} for prompt in PROMPTS for lora in ("fr", None, "nope")]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "out.jsonl"
    saved = dict(os.environ)
    try:
        code = run_cli([str(source), "-o", str(out), "--model", str(tiny_checkpoint), "--prompt-column", "q",
                        "--lora", f"sql={sql}", "--lora", f"fr={fr}", "--lora-column", "adapter",
                        "--adapter", "sql", "--max-loras", "2", "--max-lora-rank", "8", "--dtype", "float32",
                        "--max-tokens", "5", "--temperature", "0", "--no-apply-chat-template",
                        "--no-progress"])
    finally:  # run exports its settings into the environment: they must not reach later tests
        os.environ.clear()
        os.environ.update(saved)
    assert code == 0, capsys.readouterr().err
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    llm = LLM(model=str(tiny_checkpoint), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8,
              num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=5)
    expected = {}
    for lora_id, (name, path) in enumerate([("sql", sql), ("fr", fr)], start=1):
        request = LoRARequest(name, lora_id, str(path))
        expected[name] = [out.text for out in llm.generate(PROMPTS, params, lora_request=request)]
    for n in range(len(PROMPTS)):
        on_fr, on_default, unknown = lines[3 * n: 3 * n + 3]
        assert (on_fr["text"], on_fr["usage"]["lora"]) == (expected["fr"][n], "fr")
        assert (on_default["text"], on_default["usage"]["lora"]) == (expected["sql"][n], "sql")
        assert unknown["error"]["code"] == "unknown_lora"
