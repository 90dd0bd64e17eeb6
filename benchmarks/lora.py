"""`bulkinfer bench lora`: many LoRA adapters mixed in one batch, against the base model and against
the adapters one after another.

Random rank-16 adapters on all 7 projections (q/k/v/o, gate/up/down), built by peft, over a base
model (default SmolLM2-135M-Instruct). One engine (``max_loras`` = the number of adapters, the
adapters read into host memory before timing) runs, in this order and on the same rows:
- base: every row without an adapter;
- mixed: row i with adapter i mod N, all in one ``generate`` (every step mixes the adapters);
- one after another: N ``generate`` calls, each with one adapter's rows;
each ``--rounds`` times, in alternating order (so a neighbour's load weighs on all three alike).
Prints output tok/s of each, mixed / base (target >= 0.7) and the one-after-another time / the
mixed time (target >= 2x), with the dtype and the CPU. ``--compare-apply`` also times the two ways
to apply the low-rank updates on the model's projection shapes (grouped by adapter, which the
engine uses, and gathered per row).
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import torch

from bulkinfer.benchmarks.engine import describe_cpu

DEFAULT_MODEL = "smollm2-135m-instruct"
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TARGET_MIXED_VS_BASE = 0.7
TARGET_MIXED_VS_SEQUENTIAL = 2.0


def build_adapters(model_dir: str, folder: Path, count: int, rank: int, seed: int) -> list[Path]:
    """`count` random PEFT LoRA adapters (B random too: PEFT's default zero B is a no-op), saved
    as ``save_pretrained`` writes them; reused when already there."""
    paths = [folder / f"adapter-{i}" for i in range(count)]
    if all((path / "adapter_model.safetensors").exists() for path in paths):
        return paths
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base: torch.nn.Module = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for i, path in enumerate(paths):
        torch.manual_seed(seed + i)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=PROJECTIONS, init_lora_weights=False)
        peft_model = get_peft_model(base, config)
        with torch.no_grad():  # small updates: the adapters change answers without wrecking them
            for name, parameter in peft_model.named_parameters():
                if "lora_B" in name:
                    parameter.mul_(0.05)
        peft_model.save_pretrained(str(path))
        base = peft_model.unload()
    return paths


def timed(run: Callable[[], list]) -> tuple[float, int]:
    started = time.perf_counter()
    outputs = run()
    seconds = time.perf_counter() - started
    errors = [o.error for o in outputs if o.error is not None]
    if errors:
        raise RuntimeError(f"{len(errors)} rows failed in the benchmark, first: {errors[0]}")
    return seconds, sum(o.num_completion_tokens for o in outputs)


def run(model_dir: str, adapter_paths: Sequence[Path], rows: int, prompt_len: int, max_tokens: int,
        dtype: str, seed: int, rounds: int = 2, out: Callable[[str], None] = print) -> dict[str, float]:
    from bulkinfer.engine import LLM, LoRARequest, SamplingParams

    loras = [LoRARequest(f"adapter-{i}", i + 1, str(path)) for i, path in enumerate(adapter_paths)]
    llm = LLM(model=model_dir, dtype=dtype, enable_lora=True, max_loras=len(loras),
              max_cpu_loras=len(loras), max_lora_rank=16, enable_prefix_caching=False)
    vocab = llm.engine.model.config.vocab_size
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab) for _ in range(prompt_len)] for _ in range(rows)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for lora in loras:
        llm.engine.load_lora(lora)  # read from disk once, before timing (a worker caches them too)
    per_row = [loras[i % len(loras)] for i in range(rows)]
    llm.generate([p[:8] for p in prompts[:len(loras)]], SamplingParams(max_tokens=2, ignore_eos=True),
                 lora_request=loras)  # warm-up: kernel selection, every adapter into a slot once

    def one_after_another() -> list:
        outputs = []
        for lora in loras:
            mine = [p for p, row_lora in zip(prompts, per_row, strict=True) if row_lora is lora]
            outputs += llm.generate(mine, params, lora_request=lora)
        return outputs

    runs = {"base": lambda: llm.generate(prompts, params),
            "mixed": lambda: llm.generate(prompts, params, lora_request=per_row),
            "sequential": one_after_another}
    totals = {name: [0.0, 0] for name in runs}
    # Rounds in alternating order (base, mixed, sequential, then back): a neighbour's load that
    # rises or falls during the run weighs on the three alike.
    for round_index in range(rounds):
        for name in (list(runs) if round_index % 2 == 0 else list(reversed(runs))):
            seconds, tokens = timed(runs[name])
            totals[name][0] += seconds
            totals[name][1] += tokens
    (base_s, base_tokens), (mixed_s, mixed_tokens), (sequential_s, sequential_tokens) = (
        totals["base"], totals["mixed"], totals["sequential"])
    figures = {"base_tps": base_tokens / base_s, "mixed_tps": mixed_tokens / mixed_s,
               "sequential_tps": sequential_tokens / sequential_s,
               "mixed_vs_base": (mixed_tokens / mixed_s) / (base_tokens / base_s),
               "mixed_vs_sequential": sequential_s / mixed_s}
    out(f"rows: {rows} ({prompt_len} prompt tokens, {max_tokens} output tokens each) x {rounds} rounds, "
        f"{len(loras)} adapters of rank 16 on {', '.join(PROJECTIONS)}; dtype {llm.dtype_choice.dtype}")
    out(f"base (no adapter)            {base_s:7.2f} s  {figures['base_tps']:8.1f} output tok/s")
    out(f"mixed ({len(loras)} adapters, one run)  {mixed_s:7.2f} s  {figures['mixed_tps']:8.1f} output tok/s")
    out(f"one adapter after another    {sequential_s:7.2f} s  {figures['sequential_tps']:8.1f} output tok/s")
    out(f"mixed / base throughput: {figures['mixed_vs_base']:.2f}x (target >= {TARGET_MIXED_VS_BASE})")
    out(f"mixed vs one after another: {figures['mixed_vs_sequential']:.2f}x faster "
        f"(target >= {TARGET_MIXED_VS_SEQUENTIAL}x)")
    return figures


def apply_gathered(x: torch.Tensor, out: torch.Tensor, slots: torch.Tensor, a: torch.Tensor,
                   b: torch.Tensor) -> torch.Tensor:
    """The other way to apply per-row updates (punica's BGMV on GPUs): each row's A and B gathered,
    then batched matrix-vector products."""
    rows = torch.nonzero(slots >= 0).squeeze(1)
    chosen = slots.index_select(0, rows)
    shrunk = torch.bmm(a.index_select(0, chosen), x.index_select(0, rows).unsqueeze(2))
    out.index_add_(0, rows, torch.bmm(b.index_select(0, chosen), shrunk).squeeze(2))
    return out


def compare_apply(model_dir: str, dtype: str, num_adapters: int, rank: int,
                  out: Callable[[str], None] = print, repeats: int = 5) -> None:
    """Time the grouped (engine) and gathered ways on the model's fused qkv and gate_up shapes."""
    from bulkinfer.engine.lora.rows import LoRARows
    from bulkinfer.engine.lora.slots import LoRASlots
    from bulkinfer.engine.models.loader import model_config_from_dir

    c = model_config_from_dir(model_dir)
    torch_dtype = getattr(torch, dtype)
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {"qkv_proj": (c.hidden_size, q + 2 * kv, 3),
              "gate_up_proj": (c.hidden_size, 2 * c.intermediate_size, 2),
              "down_proj": (c.intermediate_size, c.hidden_size, 1)}
    for name, (in_features, out_features, fused) in shapes.items():
        width = fused * rank
        slots = LoRASlots(num_adapters, width, in_features, out_features, torch_dtype, torch.device("cpu"),
                          step_rows=None)
        slots.a.normal_()
        slots.bt.normal_()
        slots.widths = [width] * num_adapters
        for num_rows, label in ((256, "decode step, 256 rows"), (4096, "prefill step, 4096 rows")):
            x = torch.randn(num_rows, in_features, dtype=torch_dtype)
            base = torch.randn(num_rows, out_features, dtype=torch_dtype)
            # The runner orders a step's rows by adapter: grouped applies to slices of them.
            row_slots = torch.sort(torch.arange(num_rows) % num_adapters).values

            rows = LoRARows(row_slots)
            grouped = min(_seconds(partial(slots.add_updates, x, base.clone(), rows)) for _ in range(repeats))
            gathered = min(_seconds(partial(apply_gathered, x, base.clone(), row_slots, slots.a,
                                                    slots.bt.transpose(1, 2)))
                           for _ in range(repeats))
            out(f"apply {name} ({label}, {num_adapters} adapters): grouped {grouped * 1e3:.2f} ms, "
                f"gathered per row {gathered * 1e3:.2f} ms ({gathered / grouped:.1f}x)")


def _seconds(work: Callable[[], object]) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def bench_cli(argv: list[str] | None = None, resolve_model: Callable[[str], str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bulkinfer bench lora", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"a model folder, or from the CLI a catalog name or .gguf "
                             f"(default {DEFAULT_MODEL})")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=2,
                        help="times each run is repeated, in alternating order (times summed)")
    parser.add_argument("--adapters-dir", default=None,
                        help="where the random adapters are written (and reused); default: a temporary "
                             "folder")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--compare-apply", action="store_true",
                        help="also time grouped vs gathered application of the updates")
    args = parser.parse_args(argv)
    model_dir = resolve_model(args.model) if resolve_model else args.model
    if args.threads:
        torch.set_num_threads(args.threads)
    describe_cpu()
    from bulkinfer.engine.dtype_choice import cpu_model_name

    print(f"cpu: {cpu_model_name()}, torch threads {torch.get_num_threads()}; model: {model_dir}")
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(args.adapters_dir) if args.adapters_dir else Path(scratch)
        paths = build_adapters(model_dir, folder, args.adapters, args.rank, args.seed)
        if args.compare_apply:
            from bulkinfer.engine.dtype_choice import resolve_dtype

            dtype = resolve_dtype(args.dtype, "cpu", None).dtype
            compare_apply(model_dir, dtype, args.adapters, args.rank)
        run(model_dir, paths, args.rows, args.prompt_len, args.max_tokens, args.dtype, args.seed, args.rounds)
    return 0
