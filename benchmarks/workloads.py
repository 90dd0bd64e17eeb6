"""Token-id workloads of exact lengths and a timed `LLM.generate`: what `bench engine`
(benchmarks/engine.py), its `--structured` mode (benchmarks/structured.py) and `bench engine-only`
share."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bulkinfer.engine import LLM, RequestOutput, SamplingParams


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    max_tokens: int

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def make_workload(name: str, *, num_requests: int, vocab_size: int, special_ids: set[int],
                  shared_len: int, tail_len: int, num_shared: int, max_tokens: int,
                  seed: int = 0) -> Workload:
    """Token-id prompts of exact lengths; with num_shared == 0 every prompt is unique."""
    rng = random.Random(seed)
    ordinary = [t for t in range(vocab_size) if t not in special_ids]

    def tokens(n: int) -> list[int]:
        return [rng.choice(ordinary) for _ in range(n)]

    if num_shared:
        instructions = [tokens(shared_len) for _ in range(num_shared)]
        prompts = [instructions[i % num_shared] + tokens(tail_len) for i in range(num_requests)]
    else:
        prompts = [tokens(shared_len + tail_len) for _ in range(num_requests)]
    return Workload(name=name, prompts=prompts, max_tokens=max_tokens)


def timed_generate(
    llm: LLM, prompts: list[list[int]], params: SamplingParams
) -> tuple[list[RequestOutput], float]:
    """``llm.generate`` and its wall time in seconds; any failed request fails the benchmark."""
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    wall = time.perf_counter() - started
    errors = [o.error for o in outputs if o.finish_reason == "error"]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed in the benchmark, first: {errors[0]}")
    return outputs, wall
