"""Decode steps and a prefill chunk of the real engine, each beside what the device could do at best.

    python -m bulkinfer.benchmarks.roofline --model DIR [--device cuda] [--dtype bfloat16]
        [--rows 128,512] [--context 1024] [--prefill-tokens 4096] [--json FILE]

First it measures the device: copy bandwidth (one large device-to-device copy, bytes read + written)
and the matmul rate (a large square GEMM in the model's dtype). Then, on the engine's own runner
(through `engine.step()`, as `bench step` times it), decode steps at each `--rows` with `--context`
tokens of context per row, in two cases: every row its own context ("unique"), and rows sharing a
prefix of all but their last block ("shared", the prefix in the prefix cache once). Each step is
printed beside its roofline:

    roofline = max(bytes / bandwidth, FLOPs / matmul rate)
    bytes    = the weights a step reads once (layers, final norm, LM head) + the K/V each row attends
               (a shared prefix once)
    FLOPs    = 2 x those parameters x rows + 4 x layers x query width x positions attended

and roofline / step as a percentage (the target: >= 50%). Last, one `--prefill-tokens` chunk of a
fresh prompt in one step: MFU = (2 x layer parameters x tokens + causal attention FLOPs) / time /
matmul rate. Where the baseline file has this model's shape, the earlier step times print beside.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from bulkinfer.benchmarks.gpu_baseline import load_baseline, shape_key
from bulkinfer.benchmarks.step_profile import start_decoding, step_ms, sync_device
from bulkinfer.engine.checkpoints import cached_checkpoint

if TYPE_CHECKING:
    from bulkinfer.engine.models.llama import LlamaForCausalLM

BLOCK = 16  # the engine's KV block size (EngineConfig's default, which this benchmark keeps)


@dataclass
class ModelShape:
    """What a decode step reads and computes, from the loaded model's own tensors."""

    layer_params: int  # every decoder layer's parameters
    step_params: int  # what a decode step multiplies by: layers, final norm, LM head
    weight_bytes: int  # those, in the dtype they are held in
    num_layers: int
    query_width: int  # heads x head dim
    kv_bytes_per_token: int  # K and V of one position, every layer


@dataclass
class DecodeCase:
    case: str
    rows: int
    context: float  # mean positions each row attends over the timed steps
    step_ms: float
    bytes: float
    flops: float
    memory_ms: float
    compute_ms: float
    roofline_ms: float
    ratio: float  # roofline / step
    prefix_hit_rate: float  # of the rows' prefill: the unique case's prompts, the shared prefix
    earlier_step_ms: float | None = None


def model_shape(model: LlamaForCausalLM, kv_dtype: torch.dtype) -> ModelShape:
    config = model.config
    read = [*model.layers.parameters(), *model.norm.parameters(), model.lm_head.weight]
    return ModelShape(
        layer_params=sum(p.numel() for p in model.layers.parameters()),
        step_params=sum(p.numel() for p in read),
        weight_bytes=sum(p.numel() * p.element_size() for p in read),
        num_layers=config.num_layers,
        query_width=config.num_heads * config.head_dim,
        kv_bytes_per_token=2 * config.num_layers * config.num_kv_heads * config.head_dim * kv_dtype.itemsize,
    )


def decode_cost(shape: ModelShape, contexts: Sequence[float], shared_prefix: int) -> tuple[float, float]:
    """(bytes, FLOPs) of one decode step over rows attending `contexts` positions each, the first
    `shared_prefix` of them the same blocks for every row (read once, attended by each)."""
    positions = sum(contexts)
    kv = shared_prefix + sum(c - shared_prefix for c in contexts)
    flops = 2 * shape.step_params * len(contexts) + 4 * shape.num_layers * shape.query_width * positions
    return shape.weight_bytes + shape.kv_bytes_per_token * kv, flops


def prefill_flops(shape: ModelShape, tokens: int) -> float:
    """One chunk of `tokens` from position 0: the layers' matmuls, causal attention, one LM-head row."""
    causal = tokens * (tokens + 1) // 2
    lm_head = shape.step_params - shape.layer_params
    return 2 * shape.layer_params * tokens + 2 * lm_head + 4 * shape.num_layers * shape.query_width * causal


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(device)
    from bulkinfer.cpu_isa import machine_kind
    from bulkinfer.engine.cpu_features import cpu_flags, cpu_model_name

    kind = machine_kind(cpu_flags()) or "below AVX2"
    return f"{cpu_model_name()} ({kind}, {torch.get_num_threads()} threads)"


def seconds_per_call(fn: Callable[[], Any], device: str, reps: int) -> float:
    """Mean seconds of `fn` after two warm calls: CUDA events on a GPU, the wall clock on a CPU."""
    for _ in range(2):
        fn()
    if device.startswith("cuda"):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / reps
    started = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - started) / reps


def copy_bandwidth(device: str, mib: int, reps: int = 10) -> float:
    """Bytes per second of one device-to-device copy of `mib` MiB (read once + written once)."""
    src = torch.ones(mib << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = seconds_per_call(lambda: dst.copy_(src), device, reps)
    return 2 * (mib << 20) / seconds


def matmul_rate(device: str, dtype: torch.dtype, size: int, reps: int = 10) -> float:
    """FLOP/s of a `size` x `size` matmul in `dtype`, written into a preallocated output."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    out = torch.empty(size, size, device=device, dtype=dtype)
    seconds = seconds_per_call(lambda: torch.mm(a, b, out=out), device, reps)
    return 2 * size ** 3 / seconds


def random_prompts(rng: random.Random, vocab: list[int], count: int, length: int,
                   prefix: list[int] | None = None) -> list[list[int]]:
    head = prefix or []
    return [head + [rng.choice(vocab) for _ in range(length - len(head))] for _ in range(count)]


def time_decode(engine: Any, shape: ModelShape, case: str, prompts: list[list[int]], warm: list[list[int]],
                rows: Sequence[int], shared_prefix: int, warmup: int, steps: int,
                bandwidth: float, rate: float) -> list[DecodeCase]:
    """Prefill `prompts` (after `warm`, prefilled alone to put their blocks in the prefix cache, so the
    rows start decoding within a step of each other), then time steps at each row count, largest first
    (the rows beyond it aborted)."""
    from bulkinfer.engine import SamplingParams

    def params(max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    start_decoding(engine, warm, params(1), f"{case}-warm")
    before = engine.get_metrics()
    start_decoding(engine, prompts, params((warmup + steps) * len(rows) + 8), case)
    after = engine.get_metrics()
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    hit_rate = (after["prefix_cache_hits"] - before["prefix_cache_hits"]) / queries if queries else 0.0
    results = []
    for count in sorted(rows, reverse=True):
        for index in range(count, len(prompts)):
            engine.abort_request(f"{case}{index}")
        for _ in range(warmup):  # also: a GPU captures this batch size's graph here
            engine.step()
        running = engine.scheduler.running
        if len(running) != count:
            raise RuntimeError(f"{case}: {len(running)} rows decoding, expected {count} (preempted? "
                               "too few KV blocks?)")
        contexts = [r.num_tokens + (steps - 1) / 2 for r in running]
        ms = step_ms(engine, steps)
        nbytes, flops = decode_cost(shape, contexts, shared_prefix)
        memory_ms, compute_ms = nbytes / bandwidth * 1e3, flops / rate * 1e3
        roofline_ms = max(memory_ms, compute_ms)
        results.append(DecodeCase(case, count, sum(contexts) / count, ms, nbytes, flops, memory_ms,
                                  compute_ms, roofline_ms, roofline_ms / ms, hit_rate))
    for index in range(len(prompts)):
        engine.abort_request(f"{case}{index}")
    while engine.has_unfinished_requests():
        engine.step()
    return sorted(results, key=lambda r: r.rows)


def time_prefill(engine: Any, shape: ModelShape, rng: random.Random, vocab: list[int], tokens: int,
                 reps: int, rate: float) -> dict[str, float]:
    """One step that prefills a fresh `tokens`-token prompt (no prefix hit), best of `reps` after one."""
    from bulkinfer.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times = []
    for rep in range(reps + 1):
        [prompt] = random_prompts(rng, vocab, 1, tokens)
        engine.add_request(f"prefill{rep}", prompt, params)
        steps_before = engine.counters.num_steps
        started = time.perf_counter()
        while engine.has_unfinished_requests():  # one step; with async scheduling, taken by the next call
            engine.step()
        sync_device()
        times.append(time.perf_counter() - started)
        if engine.counters.num_steps - steps_before != 1:
            raise RuntimeError(f"a {tokens}-token prompt did not prefill in one step")
    seconds = min(times[1:])
    flops = prefill_flops(shape, tokens)
    return {"tokens": tokens, "ms": seconds * 1e3, "flops": flops, "tflops": flops / seconds / 1e12,
            "mfu": flops / seconds / rate}


def parse_rows(text: str) -> list[int]:
    rows = sorted({int(part) for part in text.split(",") if part.strip()})
    if not rows or rows[0] < 1:
        raise argparse.ArgumentTypeError(f"--rows {text!r}: expected positive counts, e.g. 128,512")
    return rows


def main(argv: list[str] | None = None) -> int:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(prog="python -m bulkinfer.benchmarks.roofline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a model folder (default: the `--preset` checkpoint)")
    parser.add_argument("--preset", default="small", choices=["tiny", "small"])
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--dtype", default="bfloat16", help="the engine's dtype (auto resolves as it does)")
    parser.add_argument("--rows", type=parse_rows, default=[128, 512], help="comma list of rows decoding")
    parser.add_argument("--context", type=int, default=1024, help="tokens of context per row")
    parser.add_argument("--shared-prefix", type=int, help="shared case's prefix (default: context - 16)")
    parser.add_argument("--prefill-tokens", type=int, default=4096, help="prefill chunk, token budget")
    parser.add_argument("--warmup", type=int, default=3, help="untimed decode steps per row count")
    parser.add_argument("--steps", type=int, default=10, help="timed decode steps per row count")
    parser.add_argument("--prefill-reps", type=int, default=3, help="prefill steps timed (best kept)")
    parser.add_argument("--copy-mib", type=int, default=1024 if cuda else 64, help="copy bandwidth's tensor")
    parser.add_argument("--gemm-size", type=int, default=8192 if cuda else 512, help="matmul rate's square")
    parser.add_argument("--triton-kernels", choices=["auto", "on", "off"], default="auto",
                        help="the engine's triton_kernels (off: the PyTorch attention path, to compare)")
    parser.add_argument("--async-scheduling", choices=["auto", "on", "off"], default="auto",
                        help="the engine's async_scheduling (off: the synchronous loop, to compare)")
    parser.add_argument("--json", type=Path, help="also write every figure here")
    args = parser.parse_args(argv)
    prefix_len = args.context - BLOCK if args.shared_prefix is None else args.shared_prefix
    if not 0 < prefix_len < args.context or args.steps < 1 or args.warmup < 0:
        parser.error("need 0 < --shared-prefix < --context, --steps >= 1, --warmup >= 0")
    from bulkinfer.engine import LLM

    model_dir = args.model or str(cached_checkpoint(preset=args.preset, arch="llama", seed=0))
    decode_tokens = (args.warmup + args.steps) * len(args.rows) + 8
    max_rows = max(args.rows)
    max_model_len = max(args.context + decode_tokens, args.prefill_tokens + 1)
    # Blocks for every row's prompt kept in the prefix cache while its copy decodes, with room to
    # spare: a full cache would evict a prompt before its copy reads it back.
    num_blocks = (max_rows * (math.ceil(args.context / BLOCK) + math.ceil(decode_tokens / BLOCK) + 2)
                  + math.ceil(max_model_len / BLOCK) + 64)
    started = time.perf_counter()
    llm = LLM(model=model_dir, dtype=args.dtype, device=args.device, max_num_seqs=max_rows,
              max_num_batched_tokens=max(args.prefill_tokens, max_rows), max_model_len=max_model_len,
              num_kv_blocks=num_blocks,
              triton_kernels={"auto": None, "on": True, "off": False}[args.triton_kernels],
              async_scheduling={"auto": None, "on": True, "off": False}[args.async_scheduling])
    engine = llm.engine
    dtype = getattr(torch, llm.dtype_choice.dtype)
    shape = model_shape(engine.model, dtype)
    print(f"device: {args.device} ({device_name(args.device)}); torch {torch.__version__}; attention "
          f"{type(engine.model.layers[0].self_attn.backend).__name__}")
    print(f"model: {model_dir}; {llm.dtype_choice.dtype}; {shape.step_params / 1e6:,.1f}M parameters read "
          f"a decode step ({shape.weight_bytes / 2**20:,.1f} MiB), K/V "
          f"{shape.kv_bytes_per_token / 1024:,.1f} KiB a position; engine up in "
          f"{time.perf_counter() - started:.1f} s")
    bandwidth = copy_bandwidth(args.device, args.copy_mib)
    rate = matmul_rate(args.device, dtype, args.gemm_size)
    print(f"copy bandwidth {bandwidth / 1e9:,.1f} GB/s ({args.copy_mib} MiB, read + written); "
          f"{llm.dtype_choice.dtype} matmul {flops_text(rate)} ({args.gemm_size}^2)")

    tokenizer = engine.tokenizer
    special = set(tokenizer.all_special_ids)
    vocab = [t for t in range(len(tokenizer)) if t not in special]
    rng = random.Random(0)
    unique = random_prompts(rng, vocab, max_rows, args.context)
    [head] = random_prompts(rng, vocab, 1, prefix_len)
    shared = random_prompts(rng, vocab, max_rows, args.context, prefix=head)
    common = dict(rows=args.rows, warmup=args.warmup, steps=args.steps, bandwidth=bandwidth, rate=rate)
    decode = (time_decode(engine, shape, "unique", unique, unique, shared_prefix=0, **common)
              + time_decode(engine, shape, "shared", shared, shared[:1], shared_prefix=prefix_len, **common))
    prefill = time_prefill(engine, shape, rng, vocab, args.prefill_tokens, args.prefill_reps, rate)

    baseline = load_baseline() or {"date": "", "shapes": {}}
    config = json.loads((Path(model_dir) / "config.json").read_text())
    key = shape_key(baseline, config.get("hidden_size"), config.get("num_hidden_layers"))
    earlier = baseline["shapes"][key] if key else {}
    for case in decode:
        case.earlier_step_ms = earlier.get("step_ms", {}).get(str(case.rows))
    beside = any(case.earlier_step_ms for case in decode)
    print_figures(decode, prefill, earlier, baseline["date"] if beside else "")
    if earlier.get("mfu_note"):
        print(f"({baseline['date']}, this shape: {earlier['mfu_note']})")
    if args.json:
        figures = {"device": device_name(args.device), "device_kind": args.device, "model": model_dir,
                   "dtype": llm.dtype_choice.dtype, "baseline_shape": key,
                   "attention": type(engine.model.layers[0].self_attn.backend).__name__,
                   "copy_bytes_per_s": bandwidth,
                   "matmul_flops_per_s": rate, "shape": asdict(shape), "decode": [asdict(c) for c in decode],
                   "prefill": prefill}
        args.json.write_text(json.dumps(figures, indent=1))
        print(f"figures: {args.json}")
    return 0


def print_figures(decode: list[DecodeCase], prefill: dict[str, float], earlier: dict[str, Any],
                  date: str) -> None:
    then = f" | {date} ms" if date else ""
    print("| case | rows | context | prefix hits | step ms | roofline ms (memory / compute) | "
          f"roofline / step (target >= 50%){then} |")
    print("| --- | ---: | ---: | ---: | ---: | --- | ---: |" + (" ---: |" if date else ""))
    for c in decode:
        beside = ""
        if date:
            beside = (f" | {c.earlier_step_ms:.1f} (then / now {c.earlier_step_ms / c.step_ms:.2f}x)"
                      if c.earlier_step_ms else " | -")
        print(f"| {c.case} | {c.rows} | {c.context:,.0f} | {c.prefix_hit_rate:.0%} | {c.step_ms:.2f} | "
              f"{c.roofline_ms:.3f} ({c.memory_ms:.3f} / {c.compute_ms:.3f}) | {c.ratio:.1%}{beside} |")
    if date and earlier.get("step_note"):
        print(f"({date}: {earlier['step_note']})")
    print(f"prefill: {prefill['tokens']:,} tokens in one step, {prefill['ms']:.2f} ms, "
          f"{flops_text(prefill['tflops'] * 1e12)}: MFU {prefill['mfu']:.1%} (target on the 1B shape >= 50%)")


def flops_text(per_s: float) -> str:
    return f"{per_s / 1e12:,.1f} TFLOP/s" if per_s >= 1e12 else f"{per_s / 1e9:,.1f} GFLOP/s"


if __name__ == "__main__":
    raise SystemExit(main())
