"""`bulkinfer bench suite`: the engine over the workloads batch users run, with the figures to judge it.

One process, one run per (workload, dtype); every figure printed comes from that run. Workloads
(token-id prompts of exact lengths, greedy, EOS ignored, all requests at once; `--scale` shrinks
the request counts, never the lengths):

| name | requests | prompt | output |
| --- | --- | --- | --- |
| shared-4x400 | 256 | one of 4 shared 400-token instructions + a 50-token tail | 64 |
| shared-16x200 | 96 | one of 16 shared 200-token instructions + a 60-token tail | 96 |
| shared-8x300 | 128 | one of 8 shared 300-token instructions + a 50-token tail | 64 |
| unique | 256 | 450 unique tokens | 64 |
| long-prompt | 16 | 2,000 unique tokens | 32 |
| long-output | 32 | 64 unique tokens | 512 |
| mixed | 128 | 32-1,024 tokens, a quarter under one of 4 shared 256-token instructions | 16-256 |

For each run: wall time, output and total tok/s; TTFT, ITL (every gap between two output tokens)
and TPOT (per request) as mean / p50 / p99; the prefix-cache hit rate; the process's peak RSS so
far; and model FLOPs utilization: achieved FLOP/s (2 x layer parameters x computed tokens + 2 x LM
head parameters x sampled tokens + 4 x layers x query width x attended positions) over the
machine's matmul peak in that dtype, measured in the same run through the kernel the model's
projections use. A table, and with `--json FILE` the same figures as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import random
import resource
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from bulkinfer.engine.checkpoints import cached_checkpoint
from bulkinfer.engine.config import EngineConfig

if TYPE_CHECKING:
    from bulkinfer.engine.models.llama import LlamaForCausalLM


@dataclass
class SuiteWorkload:
    name: str
    prompts: list[list[int]]
    max_tokens: list[int]  # per request

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))


@dataclass
class Distribution:
    mean: float
    p50: float
    p99: float

    @staticmethod
    def of(values: Sequence[float]) -> Distribution:
        if not values:
            return Distribution(0.0, 0.0, 0.0)
        ordered = sorted(values)
        return Distribution(statistics.fmean(ordered), _percentile(ordered, 50), _percentile(ordered, 99))


@dataclass
class SuiteResult:
    workload: str
    dtype: str
    requests: int
    wall_s: float
    prompt_tokens: int
    output_tokens: int
    output_tps: float
    total_tps: float
    ttft_s: Distribution
    itl_s: Distribution
    tpot_s: Distribution
    prefix_hit_rate: float
    peak_rss_mib: float
    achieved_gflops: float
    peak_gflops: float
    mfu: float
    cached_tokens: int = 0
    load_s: float = 0.0  # engine construction: weights, KV cache sizing, kernels (cold start)
    resolved_dtype: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def _percentile(ordered: Sequence[float], q: float) -> float:
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def make_workloads(names: Sequence[str], vocab_size: int, special_ids: set[int], scale: float = 1.0,
                   seed: int = 0) -> list[SuiteWorkload]:
    rng = random.Random(seed)
    ordinary = [t for t in range(vocab_size) if t not in special_ids]

    def tokens(n: int) -> list[int]:
        return [rng.choice(ordinary) for _ in range(n)]

    def count(n: int) -> int:
        return max(2, round(n * scale))

    def shared(name: str, requests: int, groups: int, shared_len: int, tail_len: int,
               out: int) -> SuiteWorkload:
        instructions = [tokens(shared_len) for _ in range(groups)]
        n = count(requests)
        return SuiteWorkload(name, [instructions[i % groups] + tokens(tail_len) for i in range(n)], [out] * n)

    def unique(name: str, requests: int, length: int, out: int) -> SuiteWorkload:
        n = count(requests)
        return SuiteWorkload(name, [tokens(length) for _ in range(n)], [out] * n)

    def mixed() -> SuiteWorkload:
        n = count(128)
        instructions = [tokens(256) for _ in range(4)]
        prompts = [(instructions[i // 4 % 4] if i % 4 == 0 else []) + tokens(rng.randint(32, 768))
                   for i in range(n)]
        return SuiteWorkload("mixed", prompts, [rng.randint(16, 256) for _ in range(n)])

    builders: dict[str, Callable[[], SuiteWorkload]] = {
        "shared-4x400": lambda: shared("shared-4x400", 256, 4, 400, 50, 64),
        "shared-16x200": lambda: shared("shared-16x200", 96, 16, 200, 60, 96),
        # issue 13's SmolLM2 row (128 rows under 8 shared 300-token instructions, 64 out)
        "shared-8x300": lambda: shared("shared-8x300", 128, 8, 300, 50, 64),
        "unique": lambda: unique("unique", 256, 450, 64),
        "long-prompt": lambda: unique("long-prompt", 16, 2000, 32),  # fits a 2,048-position model
        "long-output": lambda: unique("long-output", 32, 64, 512),
        "mixed": mixed,
    }
    unknown = [name for name in names if name not in builders]
    if unknown:
        raise ValueError(f"unknown workload {unknown[0]!r} (known: {', '.join(builders)})")
    return [builders[name]() for name in names]


WORKLOADS = ("shared-4x400", "shared-16x200", "shared-8x300", "unique", "long-prompt", "long-output", "mixed")


def matmul_peak_gflops(dtype: torch.dtype, device: str) -> float:
    """The machine's matmul rate in this dtype, through the model projections' own kernel."""
    if device != "cpu":
        size = 4096
        a = torch.randn(size, size, device=device, dtype=dtype)
        for _ in range(3):
            a @ a
        torch.cuda.synchronize(device)
        started = time.perf_counter()
        for _ in range(10):
            a @ a
        torch.cuda.synchronize(device)
        return 2 * size ** 3 * 10 / (time.perf_counter() - started) / 1e9
    from bulkinfer.engine.dtype_benchmark import matmul_gflops

    return matmul_gflops(dtype, seconds=0.25)


def model_flops(model: LlamaForCausalLM, workload: SuiteWorkload, outputs: Sequence[Any]) -> float:
    """FLOPs the engine computed: the projections of every computed token, the LM head of every
    sampled one, and attention over every position each computed token attends."""
    config = model.config
    body = sum(p.numel() for layer in model.layers for p in layer.parameters())
    head = model.lm_head.weight.numel()
    query_width = config.num_heads * config.head_dim
    computed = attended = sampled = 0
    for prompt, output in zip(workload.prompts, outputs, strict=True):
        start, end = output.num_cached_tokens, len(prompt) + output.num_completion_tokens - 1
        computed += end - start
        attended += (end * (end + 1) - start * (start + 1)) // 2  # positions start+1 .. end
        sampled += output.num_completion_tokens
    return 2 * body * computed + 2 * head * sampled + 4 * config.num_layers * query_width * attended


def run_workload(model_dir: str, workload: SuiteWorkload, dtype: str,
                 engine_kwargs: dict[str, Any]) -> SuiteResult:
    from bulkinfer.engine import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(model=model_dir, dtype=dtype, **engine_kwargs)
    load_s = time.perf_counter() - started
    warm = [p[-8:] for p in workload.prompts[:2]]
    llm.generate(warm, SamplingParams(max_tokens=2, ignore_eos=True))
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in workload.max_tokens]
    started = time.perf_counter()
    outputs = llm.generate(workload.prompts, params)
    wall = time.perf_counter() - started
    failed = [o.error for o in outputs if o.finish_reason == "error"]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, first: {failed[0]}")
    chosen = llm.dtype_choice.dtype
    metrics = [o.metrics for o in outputs if o.metrics is not None]
    gaps = [b - a for m in metrics for a, b in zip(m.token_times, m.token_times[1:], strict=False)]
    output_tokens = sum(o.num_completion_tokens for o in outputs)
    cached_tokens = sum(o.num_cached_tokens for o in outputs)
    flops = model_flops(llm.engine.model, workload, outputs)
    peak = matmul_peak_gflops(getattr(torch, chosen), engine_kwargs.get("device", "cpu"))
    achieved = flops / wall / 1e9
    result = SuiteResult(
        workload=workload.name, dtype=chosen if dtype == chosen else f"{dtype}->{chosen}",
        requests=len(workload.prompts), wall_s=wall, prompt_tokens=workload.prompt_tokens,
        output_tokens=output_tokens, output_tps=output_tokens / wall,
        total_tps=(workload.prompt_tokens + output_tokens) / wall,
        ttft_s=Distribution.of([m.time_to_first_token for m in metrics if m.time_to_first_token is not None]),
        itl_s=Distribution.of(gaps),
        tpot_s=Distribution.of([m.time_per_output_token for m in metrics
                                if m.time_per_output_token is not None]),
        prefix_hit_rate=cached_tokens / workload.prompt_tokens,
        peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        achieved_gflops=achieved, peak_gflops=peak, mfu=achieved / peak if peak else 0.0,
        cached_tokens=cached_tokens, load_s=load_s, resolved_dtype=chosen,
        extra={"preemptions": llm.get_metrics()["num_preemptions"]},
    )
    # A GPU engine sizes its KV cache from free memory: hand this one's back before the next starts.
    del llm, outputs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def median_run(runs: Sequence[Any]) -> Any:
    """The run of median wall time (the lower of the middle two for an even count)."""
    return sorted(runs, key=lambda run: run.wall_s)[(len(runs) - 1) // 2]


def print_table(results: Sequence[SuiteResult], out: Callable[[str], None] = print) -> None:
    out("| workload | dtype | requests | wall s | output tok/s | total tok/s | TTFT mean / p50 / p99 s | "
        "ITL mean / p50 / p99 ms | TPOT mean / p99 ms | prefix hit | peak RSS MiB | GFLOP/s | MFU |")
    out("| --- | --- | ---: | ---: | ---: | ---: | --- | --- | --- | ---: | ---: | ---: | ---: |")
    for r in results:
        out(f"| {r.workload} | {r.dtype} | {r.requests} | {r.wall_s:.2f} | {r.output_tps:,.1f} | "
            f"{r.total_tps:,.1f} | {r.ttft_s.mean:.2f} / {r.ttft_s.p50:.2f} / {r.ttft_s.p99:.2f} | "
            f"{r.itl_s.mean * 1e3:.0f} / {r.itl_s.p50 * 1e3:.0f} / {r.itl_s.p99 * 1e3:.0f} | "
            f"{r.tpot_s.mean * 1e3:.0f} / {r.tpot_s.p99 * 1e3:.0f} | {r.prefix_hit_rate:.1%} | "
            f"{r.peak_rss_mib:,.0f} | {r.achieved_gflops:,.0f} of {r.peak_gflops:,.0f} | {r.mfu:.1%} |")


def bench_cli(argv: list[str] | None = None, resolve_model: Callable[[str], str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bulkinfer bench suite", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a model folder (from the CLI also a catalog name or a .gguf file); "
                        "default: the --preset checkpoint")
    parser.add_argument("--preset", default="small", choices=["tiny", "small"])
    parser.add_argument("--dtype", default="auto", help="comma list of auto, float32, bfloat16, float16")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"comma list of: {', '.join(WORKLOADS)}")
    parser.add_argument("--scale", type=float, default=1.0, help="request counts x this (lengths stay)")
    parser.add_argument("--max-num-seqs", type=int, default=EngineConfig.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int,
                        default=EngineConfig.max_num_batched_tokens)
    parser.add_argument("--kv-populate-seconds", type=float, default=EngineConfig.kv_populate_seconds,
                        help="how long engine start may map the KV cache's memory (default %(default)s; "
                        "a large value maps all of it, as vLLM's start does by zeroing its cache)")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="run each workload N times (each followed by vLLM's run with --with-vllm) "
                        "and report each side's run of median wall: this machine's hour moves a wall by "
                        "up to 10%%, a ratio's two sides independently")
    parser.add_argument("--batch-invariant", choices=["auto", "on", "off"], default="auto",
                        help="the engine's batch_invariant (auto: on for CPU); off measures its cost")
    parser.add_argument("--json", type=Path, help="also write the figures here as JSON")
    parser.add_argument("--with-vllm", type=Path, metavar="VENV",
                        help="also run vLLM from this virtualenv on the same workloads (docs/benchmarks.md)")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat must be at least 1, got {args.repeat}")
    if args.model:
        model_dir = resolve_model(args.model) if resolve_model else args.model
    else:
        model_dir = str(cached_checkpoint(preset=args.preset, arch="llama", seed=0))
    from transformers import AutoTokenizer

    from bulkinfer.benchmarks.engine import describe_cpu

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    print(f"model: {model_dir}; torch threads: {torch.get_num_threads()}; device: {args.device}")
    if args.device == "cpu":
        describe_cpu()
    names = [name.strip() for name in args.workloads.split(",") if name.strip()]
    try:
        workloads = make_workloads(names, len(tokenizer), set(tokenizer.all_special_ids), args.scale)
    except ValueError as error:
        parser.error(str(error))
    engine_kwargs = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                     "device": args.device, "kv_populate_seconds": args.kv_populate_seconds,
                     "batch_invariant": {"auto": None, "on": True, "off": False}[args.batch_invariant]}
    results: list[SuiteResult] = []
    pairs: list[tuple[SuiteResult, Any]] = []
    for dtype in [d.strip() for d in args.dtype.split(",") if d.strip()]:
        with contextlib.ExitStack() as stack:
            vllm = None
            for workload in workloads:
                ours_runs, theirs_runs = [], []
                for attempt in range(args.repeat):
                    done = run_workload(model_dir, workload, dtype, engine_kwargs)
                    ours_runs.append(done)
                    # a line as each run ends: a run cut short by a time limit keeps what it measured
                    run = f" run {attempt + 1}/{args.repeat}" if args.repeat > 1 else ""
                    print(f"{done.workload} ({done.dtype}){run}: {done.wall_s:.2f} s, "
                          f"{done.output_tps:,.1f} output tok/s, MFU {done.mfu:.1%}", flush=True)
                    if not args.with_vllm:
                        continue
                    if vllm is None:
                        # Loaded after bulkinfer's first run, so that run (whose engine maps fresh
                        # memory, as a worker's first job does) has the machine alone, as a worker
                        # would; then each workload goes to vLLM right after bulkinfer's run of it.
                        from bulkinfer.benchmarks.vllm_compare import VllmSession

                        vllm = stack.enter_context(VllmSession(args.with_vllm, model_dir, done.resolved_dtype,
                                                               log_dir=Path(".bulkinfer") / "bench"))
                        print(f"vLLM ({done.resolved_dtype}) loaded in {vllm.load_s:.1f} s", flush=True)
                    theirs = vllm.run(workload)
                    theirs_runs.append(theirs)
                    print(f"  vLLM: {theirs.wall_s:.2f} s, {theirs.output_tps:,.1f} output tok/s "
                          f"(bulkinfer {done.output_tps / theirs.output_tps:.2f}x)", flush=True)
                results.append(median_run(ours_runs))
                if args.repeat > 1:
                    results[-1].extra["repeat_walls_s"] = [run.wall_s for run in ours_runs]
                if theirs_runs:
                    pairs.append((results[-1], median_run(theirs_runs)))
    print_table(results)
    if pairs:
        from bulkinfer.benchmarks.vllm_compare import print_comparison

        print_comparison(pairs)
    if args.json:
        figures: dict[str, Any] = {"bulkinfer": [asdict(result) for result in results]}
        if pairs:
            figures["vllm"] = [asdict(theirs) for _, theirs in pairs]
        args.json.write_text(json.dumps(figures, indent=1))
        print(f"figures: {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(bench_cli())
