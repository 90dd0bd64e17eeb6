"""vLLM beside the suite: the same workloads through vLLM from its own virtualenv, in the same run.

vLLM runs in a child process of that virtualenv's Python (benchmarks/vllm_side.py), one engine per
dtype, after bulkinfer's runs of that dtype (the two never compete for the cores). The figures come
back as JSON and are printed as bulkinfer ÷ vLLM output tok/s per workload.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

SIDE_SCRIPT = Path(__file__).with_name("vllm_side.py")


class VllmRunError(RuntimeError):
    """The vLLM child process failed; the message names its log."""


@dataclass
class VllmFigures:
    workload: str
    dtype: str
    wall_s: float
    output_tokens: int
    cached_tokens: int
    load_s: float

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s else 0.0


def venv_python(venv: Path) -> Path:
    python = venv / "bin" / "python"
    if not python.exists():
        raise FileNotFoundError(f"--with-vllm {venv}: no {python} (make the venv as the README says)")
    return python


def vllm_environment(base: dict[str, str] | None = None) -> dict[str, str]:
    """vLLM's CPU settings: a 4 GiB KV cache and its OpenMP threads bound to this process's cores,
    unless the caller set them."""
    env = dict(os.environ if base is None else base)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{torch.get_num_threads() - 1}")
    return env


def run_vllm(venv: Path, model_dir: str, dtype: str, workloads: Sequence[Any], log_dir: Path,
             timeout_s: float = 3600.0) -> list[VllmFigures]:
    """Every workload through one vLLM engine of this dtype; figures in workload order."""
    python = venv_python(venv)
    log_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bulkinfer-vllm-") as scratch:
        request_path, result_path = Path(scratch) / "request.json", Path(scratch) / "result.json"
        request_path.write_text(json.dumps({
            "model": model_dir, "dtype": dtype,
            "workloads": [{"name": w.name, "prompts": w.prompts, "max_tokens": w.max_tokens}
                          for w in workloads],
        }))
        log_path = log_dir / f"vllm-{dtype}.log"
        with log_path.open("w") as log:
            completed = subprocess.run([str(python), str(SIDE_SCRIPT), str(request_path), str(result_path)],
                                       stdout=log, stderr=subprocess.STDOUT, env=vllm_environment(),
                                       timeout=timeout_s, check=False)
        if completed.returncode != 0 or not result_path.exists():
            raise VllmRunError(f"vLLM ({dtype}) exited with {completed.returncode}; its output: {log_path}")
        reply = json.loads(result_path.read_text())
    return [VllmFigures(r["name"], dtype, r["wall_s"], r["output_tokens"], r["cached_tokens"],
                        reply["load_s"]) for r in reply["results"]]


def print_comparison(pairs: Sequence[tuple[Any, VllmFigures]], out: Callable[[str], None] = print) -> None:
    """pairs: (bulkinfer SuiteResult, vLLM figures) of the same workload and dtype."""
    out("| workload | dtype | bulkinfer wall s | vLLM wall s | bulkinfer out tok/s | vLLM out tok/s | "
        "bulkinfer ÷ vLLM | cached tokens bulkinfer / vLLM |")
    out("| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for ours, theirs in pairs:
        ratio = ours.output_tps / theirs.output_tps if theirs.output_tps else 0.0
        out(f"| {ours.workload} | {theirs.dtype} | {ours.wall_s:.2f} | {theirs.wall_s:.2f} | "
            f"{ours.output_tps:,.1f} | {theirs.output_tps:,.1f} | {ratio:.2f}× | "
            f"{ours.cached_tokens:,} / {theirs.cached_tokens:,} |")
    for dtype in dict.fromkeys(theirs.dtype for _, theirs in pairs):
        ours_load = max(o.load_s for o, t in pairs if t.dtype == dtype)
        vllm_load = next(t.load_s for _, t in pairs if t.dtype == dtype)
        out(f"engine start ({dtype}): bulkinfer at most {ours_load:.1f} s per run, vLLM {vllm_load:.1f} s")
        # What a batch user waits for: the engine's start and then the rows. bulkinfer starts an engine
        # per workload here, vLLM one for all of them.
        ours_total = sum(o.load_s + o.wall_s for o, t in pairs if t.dtype == dtype)
        vllm_total = vllm_load + sum(t.wall_s for _, t in pairs if t.dtype == dtype)
        out(f"start and every workload ({dtype}): bulkinfer {ours_total:.1f} s, vLLM {vllm_total:.1f} s "
            f"({vllm_total / ours_total:.2f}x)")
