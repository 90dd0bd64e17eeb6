"""`bulkinfer bench step`: where one decode step's time goes, at a given batch.

Fills the engine with `--rows` requests under a few shared instructions (the shape of a batch job),
runs their prefill, then times `--steps` pure decode steps: plainly (the figure that counts: the
native decode path where it applies), plainly on the Python path, then the Python path under
cProfile, whose per-function times are summed into what a step does: the matrix
multiplications (oneDNN / BLAS linear layers and the LM head), attention (the native decode and
prefix kernels, SDPA), the fused layer ops (norms, rotary, SiLU, K/V stores), sampling, scheduling
and batch preparation, and the rest (Python between the ops, the model's own glue). cProfile adds
its own cost per Python call, so the shares are of the profiled step, printed beside the plain one.
On a GPU it times the plain step, then the same steps eagerly (what the CUDA graphs gain), then
steps that each carry a new 256-token prompt beside the decode rows, with graphs and eagerly.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from bulkinfer.engine.checkpoints import cached_checkpoint

# Function names -> the part of a step they are. Leaves count their own time; the scheduling entries
# are whole calls (their cumulative time), and none of them calls a leaf listed here.
CATEGORIES = {
    "matmul": ("_linear_pointwise", "row_gemm", "linear", "addmm", "mm", "matmul", "bmm"),
    "attention": ("decode_attention", "prefix_attention", "causal_attention",
                  "_scaled_dot_product_flash_attention_for_cpu", "scaled_dot_product_attention",
                  "index_select"),
    "layer ops": ("add_rms_norm", "rope_", "silu_and_mul", "store_kv"),
    "sampling": ("sample", "argmax_rows", "amax", "argmax", "_invalid_mask", "_to_host"),
    "scheduling": ("schedule", "update_from_output", "prepare_batch"),
}
WHOLE_CALLS = {"scheduling"}


def function_name(label: str) -> str:
    """cProfile's label of a function, reduced to its name ("<built-in method torch._ops.x.y>" -> y)."""
    if label.startswith("<built-in method "):
        return label.removeprefix("<built-in method ").rstrip(">").split(" ")[0].rsplit(".", 1)[-1]
    if label.startswith("<method '"):
        return label.split("'")[1]
    return label


def categorize(stats: pstats.Stats, total_s: float) -> dict[str, float]:
    """Seconds per part of the step; "other" is what none of them covers."""
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    for (_, _, label), (_, _, own, cumulative, _) in stats.stats.items():  # type: ignore[attr-defined]
        name = function_name(label)
        for category, names in CATEGORIES.items():
            if name in names:
                seconds[category] += cumulative if category in WHOLE_CALLS else own
                break
    seconds["other (Python, glue)"] = max(0.0, total_s - sum(seconds.values()))
    return seconds


def bench_cli(argv: list[str] | None = None, resolve_model: Callable[[str], str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bulkinfer bench step", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a model folder (from the CLI also a catalog name or a .gguf file)")
    parser.add_argument("--preset", default="small", choices=["tiny", "small"])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rows", type=int, default=128, help="requests decoding together")
    parser.add_argument("--steps", type=int, default=20, help="decode steps timed")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]; on a GPU only the plain step is "
                        "timed (cProfile sees kernel launches there, not their time)")
    parser.add_argument("--trace", action="store_true", help="also run the steps under torch.profiler: the "
                        "ops by host time, and the host-device syncs a step makes (what bounds a GPU step)")
    args = parser.parse_args(argv)
    from bulkinfer.benchmarks.suite import make_workloads
    from bulkinfer.engine import LLM, SamplingParams

    if args.model:
        model_dir = resolve_model(args.model) if resolve_model else args.model
    else:
        model_dir = str(cached_checkpoint(preset=args.preset, arch="llama", seed=0))
    llm = LLM(model=model_dir, dtype=args.dtype, max_num_seqs=max(256, args.rows), device=args.device)
    tokenizer = llm.engine.tokenizer
    [workload] = make_workloads(["shared-4x400"], len(tokenizer), set(tokenizer.all_special_ids),
                                scale=args.rows / 256)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=4 * args.steps + 8, ignore_eos=True)
    start_decoding(engine, workload.prompts, params)
    engine.step()  # one untimed decode step: a GPU captures its graph here
    plain_ms = step_ms(engine, args.steps)
    if args.trace:
        print_trace(engine, args.steps, args.device)
    if args.device != "cpu":
        print(f"model: {model_dir}; dtype {llm.dtype_choice.dtype}; {len(engine.scheduler.running)} rows "
              f"decoding on {args.device} ({torch.cuda.get_device_name(args.device)})")
        print(f"decode step: {plain_ms:.1f} ms plain ({args.rows / plain_ms * 1e3:,.0f} output tok/s)")
        graphs = engine.runner.decode_graphs
        if graphs is not None:  # the same steps without CUDA graphs: what capturing them gains
            engine.runner.use_decode_graphs = False
            eager_ms = step_ms(engine, args.steps)
            engine.runner.use_decode_graphs = True
            failed = " (capture failed)" if graphs.broken else ""
            print(f"CUDA graphs: {len(graphs.graphs)} captured{failed}; eager decode step {eager_ms:.1f} ms: "
                  f"graphs {eager_ms / plain_ms:.2f}x faster")
            print_mixed_steps(engine, len(tokenizer), args.steps)
        return 0
    # The native decode path runs every layer in one C call, which cProfile cannot split: the parts
    # are those of the Python path (the same kernels, one call each), timed plainly too.
    native = engine.model.native_decode
    engine.model.native_decode = None
    python_ms = step_ms(engine, args.steps)
    profiler = cProfile.Profile()
    started = time.perf_counter()
    profiler.enable()
    for _ in range(args.steps):
        engine.step()
    profiler.disable()
    profiled_s = time.perf_counter() - started
    engine.model.native_decode = native
    parts = categorize(pstats.Stats(profiler), profiled_s)
    rows = len(engine.scheduler.running)
    print(f"model: {model_dir}; dtype {llm.dtype_choice.dtype}; {rows} rows decoding; "
          f"torch threads {torch.get_num_threads()}")
    path = ("native decode path (every layer in one call)" if native is not None
            else "Python path (the native one does not apply here)")
    print(f"decode step: {plain_ms:.1f} ms plain, {path}; Python path {python_ms:.1f} ms plain, "
          f"{profiled_s / args.steps * 1e3:.1f} ms under cProfile, split:")
    print("| part of the step | ms / step (profiled) | share |")
    print("| --- | ---: | ---: |")
    for name, seconds in parts.items():
        print(f"| {name} | {seconds / args.steps * 1e3:.1f} | {seconds / profiled_s:.0%} |")
    return 0


# Host-side waits for the device: an explicit sync, a blocking copy, or a tensor read into Python
# (.item(), .tolist(), bool(tensor)), which waits for every kernel queued before it.
SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaMemcpyAsync",
               "aten::_local_scalar_dense", "aten::item")


def print_trace(engine: Any, steps: int, device: str) -> None:
    """`steps` decode steps under torch.profiler: the ops that took the most host time, and the syncs."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=activities) as trace:
        for _ in range(steps):
            engine.step()
    averages = trace.key_averages()
    print(f"torch.profiler over {steps} decode steps, the ops by host time (self):")
    print(averages.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60))
    syncs = {event.key: event.count for event in averages if event.key in SYNC_EVENTS}
    launches = sum(event.count for event in averages if event.key in ("cudaLaunchKernel", "cuLaunchKernel",
                                                                       "cudaLaunchKernelExC"))
    print(f"per step: {launches / steps:,.0f} kernel launches; tensor reads into Python and device syncs "
          + (", ".join(f"{name} {count / steps:,.1f}" for name, count in syncs.items()) or "none seen"))


def start_decoding(engine: Any, prompts: Sequence[Sequence[int]], params: Any, prefix: str = "r") -> None:
    """Add `prompts` as requests `{prefix}0`, `{prefix}1`, ... and step the engine until none is left
    waiting or prefilling (with max_tokens=1 each one finishes there: its blocks stay in the prefix cache)."""
    for index, prompt in enumerate(prompts):
        engine.add_request(f"{prefix}{index}", list(prompt), params)
    while engine.scheduler.num_waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                              for r in engine.scheduler.running):
        engine.step()


MIXED_PROMPT_TOKENS = 256  # the prefill chunk beside the decode rows in a timed mixed step


def mixed_step_ms(engine: Any, vocab_size: int, steps: int, seed: int) -> float:
    """Mean wall ms of `steps` steps that each carry a new 256-token prompt (its own tokens: no
    prefix hit) beside the decode rows: the steady state of a batch job admitting rows."""
    from bulkinfer.engine import SamplingParams

    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=1)  # done at its prefill: the decode set stays
    sync_device()
    started = time.perf_counter()
    for index in range(steps):
        prompt = [rng.randrange(10, vocab_size) for _ in range(MIXED_PROMPT_TOKENS)]
        engine.add_request(f"mixed{seed}-{index}", prompt, params)
        engine.step()
    sync_device()
    return (time.perf_counter() - started) / steps * 1e3


def print_mixed_steps(engine: Any, vocab_size: int, steps: int) -> None:
    """Mixed steps (decode rows and a prefill chunk) with the fixed-shape graphs and eagerly."""
    mixed_step_ms(engine, vocab_size, 3, seed=0)  # untimed: captures the shapes it meets
    with_graphs = mixed_step_ms(engine, vocab_size, steps, seed=1)
    engine.runner.use_decode_graphs = False
    eager = mixed_step_ms(engine, vocab_size, steps, seed=2)
    engine.runner.use_decode_graphs = True
    graphs = engine.runner.mixed_graphs
    captured = "none (the PyTorch attention path, or batch invariance)" if graphs is None else (
        f"{len(graphs.graphs)} captured" + (" (capture failed)" if graphs.broken else ""))
    print(f"mixed step (the decode rows and a {MIXED_PROMPT_TOKENS}-token prompt): {with_graphs:.1f} ms "
          f"with graphs ({captured}), {eager:.1f} ms eager: {eager / with_graphs:.2f}x")


def step_ms(engine: Any, steps: int) -> float:
    """Mean wall ms of `steps` engine steps (each ends reading its sampled tokens; synced anyway, so a
    step that someday leaves work queued on the GPU is not timed short)."""
    sync_device()
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync_device()
    return (time.perf_counter() - started) / steps * 1e3


def sync_device() -> None:
    """Wait for the GPU's queued work, where this process uses one."""
    if torch.cuda.is_initialized():  # a CPU run on a GPU machine starts no CUDA context for this
        torch.cuda.synchronize()


if __name__ == "__main__":
    raise SystemExit(bench_cli())
