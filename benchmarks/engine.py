"""`bulkinfer bench engine`: the engine against the batch loop a user would write with transformers.

Both run in this one process, on the same machine, threads and weights, over the same token-id
prompts, and the figures and ratios printed come from this one run. ``--dtype`` lists the engine
runs (``auto`` = what the engine picks on this machine; the line ``cpu: native bf16 …`` says what
and why); the baseline runs in fp32, as a user without a bf16 kernel story would. Workloads:

- shared-prefix: each request = one of 4 shared instructions (~400 tokens) + a unique ~50-token tail;
- no-shared-prefix: the same lengths, every prompt unique.

64 output tokens per request, greedy, EOS ignored. The baseline is `transformers` `generate` in
static batches of 32 with left padding.

``--tensor-parallel-size 1,2``: one engine run per size and dtype (the ranks share this machine's
threads), and each size's output tok/s against one rank's: on one CPU box that figure is what the
ranks' all-reduces and step broadcast cost, not a speed-up.

With ``--structured``: JSON-schema-constrained against unconstrained generation on one workload
instead (benchmarks/structured.py; defaults 32 requests of 64 prompt tokens, 96 output tokens).
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from bulkinfer.benchmarks.workloads import Workload, make_workload, timed_generate
from bulkinfer.engine.checkpoints import ARCHS, cached_checkpoint
from bulkinfer.engine.config import EngineConfig

if TYPE_CHECKING:
    pass


@dataclass
class RunResult:
    label: str
    wall_s: float
    prompt_tokens: int
    output_tokens: int
    extra: dict[str, float]

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def total_tps(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.wall_s


def run_transformers_baseline(model_dir: str, workload: Workload, batch_size: int,
                              dtype: torch.dtype = torch.float32, device: str = "cpu") -> RunResult:
    """What a user would write: static batches, left padding, `generate`."""
    from transformers import AutoModelForCausalLM

    # transformers wraps PreTrainedModel.to in functools.wraps, whose typeshed _Wrapped does not bind self.
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()  # type: ignore[arg-type]
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    output_tokens = 0
    started = time.perf_counter()
    with torch.inference_mode():
        for start in range(0, len(workload.prompts), batch_size):
            batch = workload.prompts[start:start + batch_size]
            width = max(len(p) for p in batch)
            input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
            attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            generated = model.generate(
                input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), do_sample=False,
                max_new_tokens=workload.max_tokens, min_new_tokens=workload.max_tokens,
                pad_token_id=pad_id,
            )
            output_tokens += (generated.shape[1] - width) * len(batch)
    wall = time.perf_counter() - started
    label = f"transformers generate {str(dtype).removeprefix('torch.')} (batches of {batch_size})"
    return RunResult(label, wall, workload.prompt_tokens, output_tokens, {})


def run_engine(model_dir: str, workload: Workload, engine_kwargs: dict) -> RunResult:
    from bulkinfer.engine import LLM, SamplingParams
    from bulkinfer.engine.metrics import EngineCounters

    llm = LLM(model=model_dir, **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=workload.max_tokens, ignore_eos=True)
    try:
        # Warm-up (first-call kernel selection) on prompts shorter than a block, so nothing is cached.
        timed_generate(llm, [p[-8:] for p in workload.prompts[:2]],
                       SamplingParams(max_tokens=2, ignore_eos=True))
        llm.engine.counters = EngineCounters()
        parallel = llm.engine.parallel
        if parallel is not None:
            parallel.communicator.seconds_in_collectives = 0.0
        outputs, wall = timed_generate(llm, workload.prompts, params)
        in_collectives = parallel.communicator.seconds_in_collectives if parallel is not None else 0.0
    finally:
        llm.engine.shutdown()  # tensor parallel: its ranks stop and this process gets its threads back
    cached = sum(o.num_cached_tokens for o in outputs)
    metrics = llm.get_metrics()
    extra = {
        "prefix_hit_rate": cached / workload.prompt_tokens,
        "prefill_tokens_computed": float(metrics["prefill_tokens_computed"]),
        "preemptions": float(metrics["num_preemptions"]),
        "collective_share": in_collectives / wall,
    }
    output_tokens = sum(o.num_completion_tokens for o in outputs)
    requested, chosen = engine_kwargs.get("dtype", "auto"), llm.dtype_choice.dtype
    ranks = engine_kwargs.get("tensor_parallel_size", 1)
    extra["tensor_parallel_size"] = float(ranks)
    label = (f"bulkinfer engine{f' tp={ranks}' if ranks > 1 else ''} "
             f"{chosen if requested == chosen else f'{requested}->{chosen}'}")
    return RunResult(label, wall, workload.prompt_tokens, output_tokens, extra)


def print_comparison(workload: Workload, baseline: RunResult | None, engines: list[RunResult], target: float,
                     out: Callable[[str], None] = print) -> bool:
    """Every run's figures, then each engine run against the baseline and each dtype against fp32."""
    out(f"\n== workload: {workload.name} — {len(workload.prompts)} requests, "
        f"{workload.prompt_tokens} prompt tokens, {workload.max_tokens} output tokens each")
    for result in ([baseline] if baseline else []) + engines:
        out(f"  {result.label:<44} wall {result.wall_s:8.2f}s   output {result.output_tps:8.1f} tok/s   "
            f"total {result.total_tps:9.1f} tok/s")
    met = True
    for engine in engines:
        if baseline is not None:
            ratio = engine.output_tps / baseline.output_tps
            met = met and ratio >= target
            verdict = "met" if ratio >= target else "NOT met"
            out(f"  {engine.label} / baseline output tok/s: {ratio:.2f}x (target >= {target}x: {verdict})")
        out(f"  {engine.label}: prefix-cache hit rate {engine.extra['prefix_hit_rate']:.1%} of prompt "
            f"tokens; prefill tokens computed {int(engine.extra['prefill_tokens_computed'])} "
            f"vs prompt tokens {workload.prompt_tokens}; preemptions {int(engine.extra['preemptions'])}")
    single = [e for e in engines if e.extra.get("tensor_parallel_size", 1) == 1]
    fp32 = next((e for e in single if e.label.endswith(" float32")), None)
    for engine in single:
        if fp32 is not None and engine is not fp32:
            out(f"  {engine.label.rsplit(' ', 1)[-1]} / float32 output tok/s: "
                f"{engine.output_tps / fp32.output_tps:.2f}x")
    for engine in engines:
        ranks = int(engine.extra.get("tensor_parallel_size", 1))
        dtype = engine.label.rsplit(" ", 1)[-1]
        one = next((e for e in single if e.label.rsplit(" ", 1)[-1] == dtype), None)
        if ranks > 1 and one is not None:
            out(f"  tp={ranks} / tp=1 output tok/s ({dtype}): {engine.output_tps / one.output_tps:.2f}x "
                f"(wall {engine.wall_s:.2f}s vs {one.wall_s:.2f}s); rank 0 in collectives "
                f"{engine.extra['collective_share']:.0%} of the wall time (all-reduces, the LM head's "
                "gather, and waiting for the other ranks)")
    return met


def describe_cpu(out: Callable[[str], None] = print) -> None:
    """Whether this CPU multiplies bf16 natively, and what ``dtype="auto"`` picks here and why."""
    from bulkinfer.engine.dtype_choice import native_bf16_products, resolve_dtype

    choice = resolve_dtype("auto", "cpu", None)
    out(f"cpu: native bf16 {'yes' if native_bf16_products() else 'no'}; dtype auto -> {choice.dtype} "
        f"({choice.reason})")


def bench_cli(argv: list[str] | None = None, resolve_model: Callable[[str], str] | None = None) -> int:
    """``resolve_model``: turns ``--model`` (a folder, or a name the caller knows) into a folder."""
    parser = argparse.ArgumentParser(prog="bulkinfer bench engine", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model folder (or, from the CLI, a catalog name such "
                        "as smollm2-135m-instruct, or a .gguf file); default: the --preset checkpoint")
    parser.add_argument("--dtype", default="auto", help="comma list of auto, float32, bfloat16, float16: "
                        "one engine run per entry, compared with float32 when it is listed")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (engine and baseline)")
    parser.add_argument("--preset", default="small", choices=["tiny", "small"])
    parser.add_argument("--arch", default="llama", choices=list(ARCHS),
                        help="the --preset checkpoint's architecture (qwen3_moe, mixtral, qwen2_moe: "
                        "mixture-of-experts; the run then also prints a decode step's routing/expert shares)")
    parser.add_argument("--requests", type=int, default=None, help="default 256 (32 with --structured)")
    parser.add_argument("--shared-len", type=int, default=400)
    parser.add_argument("--tail-len", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=None, help="default 64 (96 with --structured)")
    parser.add_argument("--baseline-batch", type=int, default=32)
    parser.add_argument("--no-baseline", action="store_true", help="skip the transformers baseline")
    parser.add_argument("--moe-profile-steps", type=int, default=16,
                        help="mixture-of-experts models: decode steps timed for the routing/expert shares")
    parser.add_argument("--workloads", default="shared,unique", help="comma list of: shared, unique")
    parser.add_argument("--max-num-seqs", type=int, default=EngineConfig.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int,
                        default=EngineConfig.max_num_batched_tokens)
    parser.add_argument("--tensor-parallel-size", default="1", metavar="N[,N...]",
                        help="comma list of rank counts: one engine run per entry and dtype (default 1)")
    parser.add_argument("--structured", action="store_true",
                        help="structured output (JSON schema) vs unconstrained on the same workload")
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per request (--structured)")
    parser.add_argument("--rounds", type=int, default=2, help="runs per side, best counts (--structured)")
    args = parser.parse_args(argv)
    dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    from bulkinfer.engine.dtype_choice import DTYPE_CHOICES

    bad = [d for d in dtypes if d not in DTYPE_CHOICES]
    if bad or not dtypes:
        parser.error(f"--dtype: {bad[0] if bad else '(empty)'!r} is not one of {', '.join(DTYPE_CHOICES)}")
    sizes = [s.strip() for s in args.tensor_parallel_size.split(",") if s.strip()]
    if not sizes or not all(s.isdigit() and int(s) >= 1 for s in sizes):
        parser.error(f"--tensor-parallel-size: {args.tensor_parallel_size!r} is not a comma list of "
                     "counts >= 1")
    ranks = [int(s) for s in sizes]
    if args.structured:
        from bulkinfer.benchmarks.structured import run_structured_bench

        run_structured_bench(
            preset=args.preset, arch=args.arch, requests=args.requests or 32, prompt_len=args.prompt_len,
            max_tokens=args.max_tokens or 96, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, rounds=args.rounds,
        )
        return 0
    args.requests = args.requests or 256
    args.max_tokens = args.max_tokens or 64

    if args.model:
        model_dir = resolve_model(args.model) if resolve_model else args.model
    else:
        model_dir = str(cached_checkpoint(preset=args.preset, arch=args.arch, seed=0))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    print(f"model: {model_dir}; torch threads: {torch.get_num_threads()}; dtypes: {', '.join(dtypes)}")
    if args.device == "cpu":
        describe_cpu()
    else:
        print(f"device: {args.device} ({torch.cuda.get_device_name(args.device)})")
    engine_kwargs = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                     "device": args.device}
    targets = {"shared": 3.0, "unique": 1.2}
    for name in args.workloads.split(","):
        workload = make_workload(
            "shared-prefix" if name == "shared" else "no-shared-prefix",
            num_requests=args.requests, vocab_size=len(tokenizer), special_ids=set(tokenizer.all_special_ids),
            shared_len=args.shared_len, tail_len=args.tail_len, num_shared=4 if name == "shared" else 0,
            max_tokens=args.max_tokens,
        )
        baseline = (None if args.no_baseline
                    else run_transformers_baseline(model_dir, workload, args.baseline_batch,
                                                   device=args.device))
        engines = [run_engine(model_dir, workload,
                              {**engine_kwargs, "dtype": dtype, "tensor_parallel_size": n})
                   for dtype in dtypes for n in ranks]
        print_comparison(workload, baseline, engines, targets[name])
    if is_mixture_of_experts(model_dir):
        for dtype in dtypes:
            print_moe_step_shares(model_dir, {**engine_kwargs, "dtype": dtype}, rows=min(args.requests, 64),
                                  steps=args.moe_profile_steps)
    return 0


def is_mixture_of_experts(model_dir: str) -> bool:
    from bulkinfer.engine.models.loader import model_config_from_dir

    return getattr(model_config_from_dir(model_dir), "num_experts", 0) > 0


def print_moe_step_shares(model_dir: str, engine_kwargs: dict, rows: int, steps: int = 16,
                          out: Callable[[str], None] = print) -> None:
    """The share of a decode step of `rows` requests spent in expert routing and expert compute."""
    from bulkinfer.benchmarks.moe_profile import profile_decode_steps
    from bulkinfer.engine import LLM, SamplingParams

    llm = LLM(model=model_dir, **engine_kwargs)
    rng = random.Random(7)
    vocab = llm.engine.model.config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(rows):
        llm.engine.add_request(f"moe-{i}", [rng.randrange(5, vocab) for _ in range(64)], params)
    shares = profile_decode_steps(llm.engine, steps)
    out(f"  bulkinfer engine {llm.dtype_choice.dtype}: {shares.describe()}")


if __name__ == "__main__":
    raise SystemExit(bench_cli())
