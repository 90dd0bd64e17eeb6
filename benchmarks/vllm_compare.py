"""vLLM beside the suite: the same workloads through vLLM from its own virtualenv, in the same run.

vLLM runs in a child process of that virtualenv's Python (benchmarks/vllm_side.py), one engine per
dtype, loaded after bulkinfer's first run of that dtype and then fed each workload right after
bulkinfer's run of it (the two never compete for the cores: the child waits idle while bulkinfer
runs). The figures come back as JSON and are printed as bulkinfer ÷ vLLM output tok/s per workload.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

SIDE_SCRIPT = Path(__file__).with_name("vllm_side.py")


class VllmRunError(RuntimeError):
    """The vLLM child process failed; the message names its log (`log_path`)."""

    def __init__(self, message: str, log_path: Path) -> None:
        super().__init__(message)
        self.log_path = log_path


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
        raise FileNotFoundError(f"--with-vllm {venv}: no {python} (make the venv as docs/benchmarks.md says)")
    return python


def vllm_environment(base: dict[str, str] | None = None) -> dict[str, str]:
    """vLLM's CPU settings: a 4 GiB KV cache and its OpenMP threads bound to this process's cores,
    unless the caller set them."""
    env = dict(os.environ if base is None else base)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{torch.get_num_threads() - 1}")
    return env


class VllmSession:
    """One vLLM engine of one dtype in a child process, serving workloads one at a time.

    Started after bulkinfer's first run of a dtype, so each workload runs through bulkinfer and
    then straight through vLLM: the pair minutes apart, not a suite apart (vLLM's own wall moved
    up to 8% between suites an hour apart on these shared machines). Between workloads the child
    waits on its stdin and uses no CPU. ``with VllmSession(...) as vllm: vllm.run(workload)``."""

    def __init__(self, venv: Path, model_dir: str, dtype: str, log_dir: Path,
                 timeout_s: float = 3600.0) -> None:
        self.python = venv_python(venv)
        self.model_dir, self.dtype, self.timeout_s = model_dir, dtype, timeout_s
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"vllm-{dtype}.log"
        self.load_s = 0.0
        self._scratch: tempfile.TemporaryDirectory[str] | None = None
        self._child: subprocess.Popen[str] | None = None
        self._count = 0

    def __enter__(self) -> VllmSession:
        self._scratch = tempfile.TemporaryDirectory(prefix="bulkinfer-vllm-")
        scratch = Path(self._scratch.name)
        settings = scratch / "settings.json"
        settings.write_text(json.dumps({"model": self.model_dir, "dtype": self.dtype}))
        with self.log_path.open("w") as log:
            self._child = subprocess.Popen([str(self.python), str(SIDE_SCRIPT), str(settings), str(scratch)],
                                           stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                                           env=vllm_environment(), text=True)
        self.load_s = self._wait_for(scratch / "ready.json")["load_s"]
        return self

    def run(self, workload: Any) -> VllmFigures:
        """The workload through the waiting engine (prefix cache reset first)."""
        assert self._child is not None and self._child.stdin is not None and self._scratch is not None
        self._count += 1
        path = Path(self._scratch.name) / f"workload-{self._count}.json"
        path.write_text(json.dumps({"name": workload.name, "prompts": workload.prompts,
                                    "max_tokens": workload.max_tokens}))
        try:
            self._child.stdin.write(f"{path}\n")
            self._child.stdin.flush()
        except BrokenPipeError:
            pass  # it has exited: _wait_for says so
        figures = self._wait_for(Path(f"{path}.result"))
        return VllmFigures(figures["name"], self.dtype, figures["wall_s"], figures["output_tokens"],
                           figures["cached_tokens"], self.load_s)

    def __exit__(self, *exc: object) -> None:
        if self._child is not None:
            if self._child.stdin is not None:
                try:
                    self._child.stdin.close()  # the child's cue to exit
                except BrokenPipeError:
                    pass
            try:
                self._child.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._child.kill()
                self._child.wait()
        if self._scratch is not None:
            self._scratch.cleanup()

    def _wait_for(self, path: Path) -> dict[str, Any]:
        """The JSON the child writes whole at `path`; VllmRunError if it exits or times out first."""
        assert self._child is not None
        deadline = time.monotonic() + self.timeout_s
        while not path.exists():
            code = self._child.poll()
            if code is not None or time.monotonic() > deadline:
                if code is None:
                    self._child.kill()
                    self._child.wait()
                what = f"exited with {code}" if code is not None else f"took over {self.timeout_s:.0f} s"
                raise VllmRunError(f"vLLM ({self.dtype}) {what}; its output: {self.log_path}", self.log_path)
            time.sleep(0.05)
        return json.loads(path.read_text())


def run_vllm(venv: Path, model_dir: str, dtype: str, workloads: Sequence[Any], log_dir: Path,
             timeout_s: float = 3600.0) -> list[VllmFigures]:
    """Every workload through one vLLM engine of this dtype; figures in workload order."""
    with VllmSession(venv, model_dir, dtype, log_dir, timeout_s) as vllm:
        return [vllm.run(workload) for workload in workloads]


# Issue 13's target: bulkinfer's output tok/s over vLLM's on every workload, in every dtype.
TARGET_RATIO = 1.25


def print_comparison(pairs: Sequence[tuple[Any, VllmFigures]], out: Callable[[str], None] = print) -> None:
    """pairs: (bulkinfer SuiteResult, vLLM figures) of the same workload and dtype."""
    out("| workload | dtype | bulkinfer wall s | vLLM wall s | bulkinfer out tok/s | vLLM out tok/s | "
        f"bulkinfer ÷ vLLM | ≥ {TARGET_RATIO}× | cached tokens bulkinfer / vLLM |")
    out("| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | --- |")
    met = 0
    for ours, theirs in pairs:
        ratio = ours.output_tps / theirs.output_tps if theirs.output_tps else 0.0
        meets = ratio >= TARGET_RATIO
        met += meets
        # Three decimals: a ratio of 1.248 printed as 1.25 would read as the target met.
        out(f"| {ours.workload} | {theirs.dtype} | {ours.wall_s:.2f} | {theirs.wall_s:.2f} | "
            f"{ours.output_tps:,.1f} | {theirs.output_tps:,.1f} | {ratio:.3f}× | "
            f"{'yes' if meets else 'no'} | {ours.cached_tokens:,} / {theirs.cached_tokens:,} |")
    out(f"rows at {TARGET_RATIO}x vLLM's output tok/s or more: {met} of {len(pairs)}")
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
