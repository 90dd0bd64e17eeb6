"""`bulkinfer bench engine --structured`: JSON-schema-constrained generation against unconstrained
generation on the same workload, in the same run and the same engine.

Same prompts, same max_tokens, same sampling (temperature 1.0, seeded), EOS ignored, prefix
caching off (so neither run reuses the other's prompts). The schema asks for a long list of
records, so no constrained output completes before max_tokens: both runs produce exactly
``requests * max_tokens`` tokens and the ratio of output tok/s is the cost of the grammar
(compile, per-step bitmask fill and apply, per-token matcher advance). Each side runs
``rounds`` times, alternating, and the best wall time of each counts: this machine is shared, and
the best run is the one least disturbed by others.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bulkinfer.engine.checkpoints import cached_checkpoint

# Long, realistic records: every output token is constrained, none of it free text for long.
BENCH_SCHEMA: dict = {
    "type": "object",
    "properties": {
        "records": {
            "type": "array",
            "minItems": 200,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0, "maximum": 99999},
                    "name": {"type": "string", "minLength": 1, "maxLength": 12},
                    "score": {"type": "number", "minimum": 0, "maximum": 1},
                    "tags": {"type": "array", "items": {"enum": ["new", "vip", "late", "eu", "us"]},
                             "maxItems": 3},
                    "active": {"type": "boolean"},
                },
                "required": ["id", "name", "score", "tags", "active"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["records"],
    "additionalProperties": False,
}
TARGET = 0.7


@dataclass
class StructuredRun:
    label: str
    wall_s: float
    output_tokens: int

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.wall_s


def run_structured_bench(*, preset: str, arch: str, requests: int, prompt_len: int, max_tokens: int,
                         max_num_seqs: int, max_num_batched_tokens: int, rounds: int = 2,
                         out: Callable[[str], None] = print) -> float:
    """Runs both sides and prints them; returns structured / unconstrained output tok/s."""
    import torch

    from bulkinfer.benchmarks.workloads import make_workload, timed_generate
    from bulkinfer.engine import LLM, SamplingParams

    model_dir = str(cached_checkpoint(preset=preset, arch=arch, seed=0))
    llm = LLM(model=model_dir, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
              enable_prefix_caching=False)
    tokenizer = llm.tokenizer
    workload = make_workload("structured", num_requests=requests, vocab_size=len(tokenizer),
                             special_ids=set(tokenizer.all_special_ids), shared_len=prompt_len, tail_len=0,
                             num_shared=0, max_tokens=max_tokens, seed=1)
    out(f"model: {model_dir}; torch threads: {torch.get_num_threads()}; dtype float32")
    out(f"\n== structured output: {requests} requests, {workload.prompt_tokens} prompt tokens, "
        f"{max_tokens} output tokens each (temperature 1.0, EOS ignored)")

    def run(label: str, **constraint: Any) -> StructuredRun:
        params = SamplingParams(temperature=1.0, seed=0, max_tokens=max_tokens, ignore_eos=True, **constraint)
        outputs, wall = timed_generate(llm, workload.prompts, params)
        return StructuredRun(label, wall, sum(o.num_completion_tokens for o in outputs))

    llm.generate(workload.prompts[:4], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    compile_started = time.perf_counter()
    llm.generate(workload.prompts[:1], SamplingParams(json_schema=BENCH_SCHEMA, max_tokens=1))
    compile_s = time.perf_counter() - compile_started
    plain, structured = run("unconstrained"), run("json_schema", json_schema=BENCH_SCHEMA)
    for _ in range(rounds - 1):
        plain = min(plain, run("unconstrained"), key=lambda r: r.wall_s)
        structured = min(structured, run("json_schema", json_schema=BENCH_SCHEMA), key=lambda r: r.wall_s)
    for result in (plain, structured):
        out(f"  {result.label:<16} wall {result.wall_s:8.2f}s   output {result.output_tps:8.1f} tok/s   "
            f"({result.output_tokens} tokens; best of {rounds})")
    out(f"  grammar compile (first request of the schema, then cached): {compile_s:.2f}s")
    ratio = structured.output_tps / plain.output_tps
    verdict = "met" if ratio >= TARGET else "NOT met"
    out(f"  structured / unconstrained output tok/s: {ratio:.2f}x (target >= {TARGET}x: {verdict})")
    return ratio
