"""Where a mixture-of-experts decode step's time goes: routing, expert compute, the rest.

Times pure decode steps of an engine already holding running requests, with wall-clock timers
around each sparse block's router (gate projection, softmax, top-k, renormalisation) and its grouped
experts (sorting the (row, slot) pairs by expert, each expert's matmuls, the weighted combine), and
around the whole step. The timers add two clock reads per block call, well under 1% of a step.
Steps on the native decode path (engine/models/native_decode.py: every layer in one C call) are
timed by that path's own clocks around the same parts (decode_layers.c's moe_seconds).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch

from bulkinfer.engine.models.sparse_moe import SparseMoeBlock


@dataclass(frozen=True)
class MoeStepShares:
    steps: int
    rows: int  # decode rows per step (the first timed step's)
    step_s: float  # mean wall time of one decode step
    routing_s: float  # of which in the routers (per step)
    experts_s: float  # of which in the grouped experts (per step)

    @property
    def routing_share(self) -> float:
        return self.routing_s / self.step_s

    @property
    def experts_share(self) -> float:
        return self.experts_s / self.step_s

    def describe(self) -> str:
        return (f"MoE decode step ({self.rows} rows, mean of {self.steps}): {self.step_s * 1e3:.1f} ms, "
                f"expert routing {self.routing_share:.1%} ({self.routing_s * 1e3:.2f} ms), "
                f"expert compute {self.experts_share:.1%} ({self.experts_s * 1e3:.2f} ms), "
                f"everything else {1 - self.routing_share - self.experts_share:.1%}")


def _timed(method: Callable[..., Any], totals: dict[str, float], key: str) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            totals[key] += time.perf_counter() - started

    return wrapper


def profile_decode_steps(engine: Any, steps: int) -> MoeStepShares:
    """Time up to `steps` engine steps that are pure decodes (prefills still pending are stepped
    through first, untimed). `engine`: an LLMEngine with running requests and a MoE model."""
    blocks = [m for m in engine.model.modules() if isinstance(m, SparseMoeBlock)]
    if not blocks:
        raise ValueError("the engine's model has no mixture-of-experts layers")
    totals = {"route": 0.0, "experts": 0.0}
    native = engine.model.native_decode
    if native is not None:
        native.moe_seconds = torch.zeros(2, dtype=torch.float64)
    timed_steps, step_time, rows = 0, 0.0, 0
    while engine.has_unfinished_requests() and timed_steps < steps:
        scheduler = engine.scheduler
        if scheduler.num_waiting or any(r.num_tokens - r.num_computed_tokens > 1 for r in scheduler.running):
            engine.step()
            continue
        rows = rows or scheduler.num_running
        for block in blocks:
            patched = cast(Any, block)  # instance attributes over the class's methods, deleted after the step
            patched.route = _timed(SparseMoeBlock.route.__get__(block), totals, "route")
            patched.grouped_experts = _timed(SparseMoeBlock.grouped_experts.__get__(block), totals, "experts")
        started = time.perf_counter()
        try:
            engine.step()
        finally:
            step_time += time.perf_counter() - started
            for block in blocks:
                del block.route, block.grouped_experts
        timed_steps += 1
    if native is not None:
        totals["route"] += float(native.moe_seconds[0])
        totals["experts"] += float(native.moe_seconds[1])
        native.moe_seconds = None
    if not timed_steps:
        raise ValueError("no pure decode step ran: give the engine requests with more output tokens")
    return MoeStepShares(timed_steps, rows, step_time / timed_steps, totals["route"] / timed_steps,
                         totals["experts"] / timed_steps)
