"""MoE decode steps as CUDA graphs against eager ones: the same tokens, and the speed of each.

Builds a Mixtral-shaped checkpoint locally (engine/checkpoints.py, 8 experts, top-2) and generates
the same greedy rows twice per dtype: with `decode_graphs=False` (eager decode steps: each expert's
rows sliced on the host) and `decode_graphs=True` (the fixed-shape path: grouped_mm over the stacked
experts, captured as CUDA graphs where the model records, i.e. bf16 on a Hopper-class GPU; on a CPU
or in fp32 the same path runs uncaptured). Prints tokens/s of each, whether graphs were captured,
how many rows have identical tokens and how much of each row agrees before its first difference
(grouped_mm and the eager path's matmuls sum in different orders: in bf16 a near-tie can flip a
token and the row goes its own way from there); exits 1 where that agreement is under
`--min-agreement`, which a wrong expert or routing would put near zero.

    python -m bulkinfer.benchmarks.moe_graphs [--device cuda] [--preset small] [--dtype bfloat16,float32]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bulkinfer.engine import LLM, SamplingParams
from bulkinfer.engine.checkpoints import cached_checkpoint


@dataclass(frozen=True)
class Run:
    tokens: list[list[int]]
    seconds: float
    captured_graphs: int  # CUDA graphs recorded (0: eager steps, or the fixed-shape path uncaptured)
    fixed_shape: bool  # whether pure decode steps took the fixed-shape path

    @property
    def tokens_per_s(self) -> float:
        return sum(len(row) for row in self.tokens) / self.seconds


def prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(rng.randrange(8, 48))] for _ in range(count)]


def generate(model_dir: str, device: str, dtype: str, rows: list[list[int]], max_tokens: int,
             decode_graphs: bool, num_kv_blocks: int | None = None) -> Run:
    sizing: dict[str, Any] = {} if num_kv_blocks is None else {"num_kv_blocks": num_kv_blocks}
    llm = LLM(model=model_dir, device=device, dtype=dtype, decode_graphs=decode_graphs, **sizing)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(rows[:2], params)  # warm-up: the first steps' allocations (and captures) not timed
    started = time.perf_counter()
    outputs = llm.generate(rows, params)
    seconds = time.perf_counter() - started
    graphs = llm.engine.runner.decode_graphs
    return Run(tokens=[list(output.token_ids) for output in outputs], seconds=seconds,
               captured_graphs=len(graphs.graphs) if graphs is not None else 0,
               fixed_shape=llm.engine.runner.use_decode_graphs)


def equal_rows(a: Run, b: Run) -> int:
    return sum(x == y for x, y in zip(a.tokens, b.tokens, strict=True))


def agreement(a: Run, b: Run) -> float:
    """The mean share of each row's tokens before its first difference between the two runs."""
    shares = []
    for x, y in zip(a.tokens, b.tokens, strict=True):
        same = next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), min(len(x), len(y)))
        shares.append(same / max(len(x), len(y), 1))
    return sum(shares) / len(shares)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bulkinfer.benchmarks.moe_graphs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--preset", default="small", help="engine/checkpoints.py preset of the Mixtral shape")
    parser.add_argument("--arch", default="mixtral")
    parser.add_argument("--dtype", default="bfloat16,float32", help="comma-separated")
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-kv-blocks", type=int, default=None,
                        help="KV cache blocks (default: sized from the device's memory)")
    parser.add_argument("--min-agreement", type=float, default=0.5,
                        help="the least mean share of a row's tokens before its first difference")
    args = parser.parse_args(argv)
    model_dir = str(cached_checkpoint(preset=args.preset, arch=args.arch, seed=0))
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    rows = prompts(args.requests, vocab)
    status = 0
    print(f"{args.arch} ({args.preset}) on {args.device}: {args.requests} rows x {args.max_tokens} tokens, "
          "greedy")
    for dtype in args.dtype.split(","):
        eager, fixed = (generate(model_dir, args.device, dtype, rows, args.max_tokens, decode_graphs,
                                 args.num_kv_blocks) for decode_graphs in (False, True))
        same, agreed = equal_rows(eager, fixed), agreement(eager, fixed)
        path = (f"CUDA graphs ({fixed.captured_graphs} captured)" if fixed.captured_graphs
                else "fixed-shape, uncaptured")
        print(f"{dtype}: eager {eager.tokens_per_s:,.1f} tok/s; {path} {fixed.tokens_per_s:,.1f} tok/s "
              f"({fixed.tokens_per_s / eager.tokens_per_s:.2f}x); tokens equal in {same}/{len(rows)} rows, "
              f"{agreed:.1%} of each row before a difference")
        if agreed < args.min_agreement:
            print(f"FAIL: {dtype}: rows agree on {agreed:.1%} of their tokens, "
                  f"under {args.min_agreement:.0%}")
            status = 1
    return status


if __name__ == "__main__":
    raise SystemExit(main())
