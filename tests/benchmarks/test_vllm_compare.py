"""`bench suite --with-vllm VENV`: the vLLM child process's protocol, its settings and the ratio table.

vLLM itself is a 3 GB install kept out of CI; these tests stand a tiny `vllm` package in for it
inside a throwaway "virtualenv" whose python is this interpreter, so the real side script, the real
subprocess call and the real parsing run.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from bulkinfer.benchmarks.suite import SuiteWorkload, bench_cli
from bulkinfer.benchmarks.vllm_compare import (
    VllmFigures,
    VllmRunError,
    print_comparison,
    run_vllm,
    vllm_environment,
)

FAKE_VLLM = '''
import json, os, time
from types import SimpleNamespace
__version__ = "0.0-test"

class SamplingParams:
    def __init__(self, max_tokens, temperature=1.0, min_tokens=0, ignore_eos=False):
        self.max_tokens = max_tokens

class LLM:
    def __init__(self, model, dtype, enable_prefix_caching, seed):
        assert enable_prefix_caching
        with open(os.environ["FAKE_VLLM_SEEN"], "a") as seen:
            seen.write(json.dumps({"model": model, "dtype": dtype,
                                   "space": os.environ.get("VLLM_CPU_KVCACHE_SPACE")}) + "\\n")
    def reset_prefix_cache(self):
        pass
    def generate(self, prompts, params, use_tqdm=True):
        if isinstance(params, list):  # a timed run (the warm-up passes one SamplingParams)
            with open(os.environ["FAKE_VLLM_SEEN"], "a") as seen:
                seen.write(json.dumps({"generate": len(prompts), "at": time.time()}) + "\\n")
        params = params if isinstance(params, list) else [params] * len(prompts)
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[7] * p.max_tokens)],
                                num_cached_tokens=len(prompt["prompt_token_ids"]) // 2)
                for prompt, p in zip(prompts, params)]
'''


def fake_venv(tmp_path: Path, fail: bool = False) -> Path:
    site = tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("raise ImportError('broken vllm')" if fail else FAKE_VLLM)
    (site / "vllm" / "inputs.py").write_text("def TokensPrompt(prompt_token_ids):\n"
                                             "    return {'prompt_token_ids': prompt_token_ids}\n")
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f"#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} \"$@\"\n")
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    return tmp_path / "venv"


def test_run_vllm_returns_figures_per_workload_and_sets_the_cpu_settings(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_VLLM_SEEN", str(tmp_path / "seen.jsonl"))
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    workloads = [SuiteWorkload("a", [[1, 2, 3, 4]] * 3, [5, 6, 7]), SuiteWorkload("b", [[9] * 10], [2])]
    figures = run_vllm(fake_venv(tmp_path), "/models/m", "bfloat16", workloads, log_dir=tmp_path / "logs")
    assert [(f.workload, f.dtype, f.output_tokens, f.cached_tokens) for f in figures] == [
        ("a", "bfloat16", 18, 6), ("b", "bfloat16", 2, 5)]
    assert all(f.wall_s > 0 and f.load_s >= 0 and f.output_tps > 0 for f in figures)
    seen = [json.loads(line) for line in (tmp_path / "seen.jsonl").read_text().splitlines()]
    assert seen[0] == {"model": "/models/m", "dtype": "bfloat16", "space": "4"}  # one engine for both
    assert [line.get("generate") for line in seen[1:]] == [3, 1]


def test_caller_settings_win_over_the_defaults() -> None:
    env = vllm_environment({"VLLM_CPU_KVCACHE_SPACE": "16", "PATH": os.environ["PATH"]})
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "16" and env["VLLM_CPU_OMP_THREADS_BIND"].startswith("0-")


def test_a_failing_vllm_names_its_log(tmp_path: Path) -> None:
    with pytest.raises(VllmRunError, match="vllm-float32.log") as caught:
        run_vllm(fake_venv(tmp_path, fail=True), "/m", "float32", [SuiteWorkload("a", [[1]], [1])],
                 log_dir=tmp_path / "logs")
    assert "broken vllm" in (tmp_path / "logs" / "vllm-float32.log").read_text()
    assert "exited with 1" in str(caught.value)
    with pytest.raises(FileNotFoundError, match="no .*bin/python"):
        run_vllm(tmp_path / "nowhere", "/m", "float32", [], log_dir=tmp_path / "logs")


def test_the_suite_prints_bulkinfer_over_vllm_per_workload(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("FAKE_VLLM_SEEN", str(tmp_path / "seen.jsonl"))
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "suite.json"
    assert bench_cli(["--preset", "tiny", "--dtype", "float32", "--workloads", "shared-4x400",
                      "--scale", "0.02", "--with-vllm", str(fake_venv(tmp_path)), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    figures = json.loads(out.read_text())
    [ours], [theirs] = figures["bulkinfer"], figures["vllm"]
    ratio = ours["output_tps"] / (theirs["output_tokens"] / theirs["wall_s"])
    assert f"| shared-4x400 | float32 | {ours['wall_s']:.2f} | {theirs['wall_s']:.2f} |" in printed
    verdict = "yes" if ratio >= 1.25 else "no"
    assert f"{ratio:.3f}× | {verdict} |" in printed and "engine start (float32): bulkinfer" in printed
    assert f"rows at 1.25x vLLM's output tok/s or more: {int(ratio >= 1.25)} of 1" in printed
    # The time a batch user waits: bulkinfer's start and run against vLLM's start and run.
    ours_total = ours["load_s"] + ours["wall_s"]
    theirs_total = figures["vllm"][0]["load_s"] + theirs["wall_s"]
    assert (f"start and every workload (float32): bulkinfer {ours_total:.1f} s, vLLM {theirs_total:.1f} s "
            f"({theirs_total / ours_total:.2f}x)") in printed


def test_a_ratio_just_under_the_target_is_printed_as_under_it() -> None:
    """1.248x is not 1.25x: three decimals and a verdict per row, and the count of rows that meet it."""
    def pair(workload: str, ours_tps: float) -> tuple[SimpleNamespace, VllmFigures]:
        ours = SimpleNamespace(workload=workload, wall_s=10.0, output_tps=ours_tps, cached_tokens=0,
                               load_s=1.0)
        return ours, VllmFigures(workload=workload, dtype="float32", wall_s=10.0, output_tokens=1000,
                                 cached_tokens=0, load_s=50.0)  # 100 tok/s

    lines: list[str] = []
    print_comparison([pair("unique", 124.8), pair("mixed", 125.0)], lines.append)
    assert any(line.startswith("| unique |") and "| 1.248× | no |" in line for line in lines)
    assert any(line.startswith("| mixed |") and "| 1.250× | yes |" in line for line in lines)
    assert "rows at 1.25x vLLM's output tok/s or more: 1 of 2" in lines


def test_the_suite_runs_each_workload_through_vllm_right_after_bulkinfer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One vLLM engine per dtype, loaded first, fed each workload as soon as bulkinfer's run of it
    ends: the two figures of a pair come from the same minutes of a shared machine."""
    import bulkinfer.benchmarks.suite as suite

    seen = tmp_path / "seen.jsonl"
    monkeypatch.setenv("FAKE_VLLM_SEEN", str(seen))
    monkeypatch.chdir(tmp_path)
    ours: list[tuple[str, float]] = []
    original = suite.run_workload

    def recorded(model_dir, workload, dtype, engine_kwargs):
        ours.append(("bulkinfer", time.time()))
        return original(model_dir, workload, dtype, engine_kwargs)

    monkeypatch.setattr(suite, "run_workload", recorded)
    assert bench_cli(["--preset", "tiny", "--dtype", "float32", "--workloads", "shared-4x400,unique",
                      "--scale", "0.02", "--with-vllm", str(fake_venv(tmp_path))]) == 0
    lines = [json.loads(line) for line in seen.read_text().splitlines()]
    assert [line.get("dtype") for line in lines if "dtype" in line] == ["float32"]
    theirs = [("vllm", line["at"]) for line in lines if "generate" in line]
    assert [who for who, _ in sorted(ours + theirs, key=lambda event: event[1])] == [
        "bulkinfer", "vllm", "bulkinfer", "vllm"]


def test_repeated_pairs_report_each_side_at_its_median_wall(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """--repeat 3: bulkinfer, vLLM, bulkinfer, vLLM, bulkinfer, vLLM on the workload; the table and
    the JSON carry each side's run of median wall, and bulkinfer's three walls."""
    seen = tmp_path / "seen.jsonl"
    monkeypatch.setenv("FAKE_VLLM_SEEN", str(seen))
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "suite.json"
    assert bench_cli(["--preset", "tiny", "--dtype", "float32", "--workloads", "shared-16x200",
                      "--scale", "0.03", "--repeat", "3", "--with-vllm", str(fake_venv(tmp_path)),
                      "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    ours_lines = [line for line in printed.splitlines() if line.startswith("shared-16x200 (float32) run ")]
    assert [line.split(":")[0] for line in ours_lines] == [
        f"shared-16x200 (float32) run {i}/3" for i in (1, 2, 3)]
    assert len([line for line in printed.splitlines() if line.startswith("  vLLM: ")]) == 3
    figures = json.loads(out.read_text())
    [ours], [theirs] = figures["bulkinfer"], figures["vllm"]
    walls = ours["extra"]["repeat_walls_s"]
    assert len(walls) == 3 and ours["wall_s"] == sorted(walls)[1]
    assert sum(1 for line in seen.read_text().splitlines() if "generate" in line) == 3
    assert theirs["wall_s"] > 0
    with pytest.raises(SystemExit):
        bench_cli(["--preset", "tiny", "--repeat", "0"])
