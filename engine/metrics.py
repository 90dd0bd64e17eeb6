"""Per-request latency metrics and engine-wide counters.

All times are ``time.monotonic()`` seconds, as on ``Request``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from bulkinfer.engine.request import Request


@dataclass(frozen=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    time_to_first_token: float | None  # first token - arrival
    mean_inter_token_latency: float | None  # mean gap between consecutive output tokens
    time_per_output_token: float | None  # (last token - first token) / (n - 1)
    e2e_latency: float | None  # finished - arrival
    # When each output token came (the request's own list, not a copy): every inter-token gap.
    token_times: Sequence[float] = ()
    engine_seconds: float = 0.0  # step time attributed to the request (its share of each step, by tokens)
    # Speculative decoding: drafts verified / accepted at each draft position (empty without).
    spec_drafted_per_position: Sequence[int] = ()
    spec_accepted_per_position: Sequence[int] = ()

    @staticmethod
    def from_request(request: Request) -> RequestMetrics:
        times = request.token_times
        first = times[0] if times else None
        decode_span = times[-1] - times[0] if len(times) > 1 else None
        per_token = decode_span / (len(times) - 1) if decode_span is not None else None
        return RequestMetrics(
            arrival_time=request.arrival_time,
            first_scheduled_time=request.first_scheduled_time,
            first_token_time=first,
            finished_time=request.finished_time,
            time_to_first_token=first - request.arrival_time if first is not None else None,
            # Gaps are consecutive, so their mean is the span over the count: no per-token loop.
            mean_inter_token_latency=per_token,
            time_per_output_token=per_token,
            e2e_latency=(
                request.finished_time - request.arrival_time if request.finished_time is not None else None
            ),
            token_times=times,
            engine_seconds=request.engine_seconds,
            spec_drafted_per_position=tuple(request.spec_drafted_per_position),
            spec_accepted_per_position=tuple(request.spec_accepted_per_position),
        )

    @staticmethod
    def merged(samples: list[RequestMetrics]) -> RequestMetrics:
        """One request's metrics over its n samples: first token of any, last finish of all;
        per-token figures are the first sample's."""
        if len(samples) == 1:
            return samples[0]
        first = samples[0]
        firsts = [m.first_token_time for m in samples if m.first_token_time is not None]
        scheduled = [m.first_scheduled_time for m in samples if m.first_scheduled_time is not None]
        ends = [m.finished_time for m in samples]
        first_token = min(firsts) if firsts else None
        finished = None if any(t is None for t in ends) else max(ends)  # type: ignore[type-var]
        return RequestMetrics(
            arrival_time=first.arrival_time,
            first_scheduled_time=min(scheduled) if scheduled else None,
            first_token_time=first_token,
            finished_time=finished,
            time_to_first_token=first_token - first.arrival_time if first_token is not None else None,
            mean_inter_token_latency=first.mean_inter_token_latency,
            time_per_output_token=first.time_per_output_token,
            token_times=first.token_times,
            e2e_latency=finished - first.arrival_time if finished is not None else None,
            engine_seconds=sum(m.engine_seconds for m in samples),
            spec_drafted_per_position=_sum_positions(m.spec_drafted_per_position for m in samples),
            spec_accepted_per_position=_sum_positions(m.spec_accepted_per_position for m in samples),
        )

    def as_dict(self) -> dict[str, float | None]:
        """The figures (the token times left out)."""
        return {key: value for key, value in asdict(self).items() if key != "token_times"}


def _sum_positions(lists: Iterable[Sequence[int]]) -> tuple[int, ...]:
    """Per-position counts of several samples, added position by position."""
    total: list[int] = []
    for counts in lists:
        total.extend([0] * (len(counts) - len(total)))
        for i, count in enumerate(counts):
            total[i] += count
    return tuple(total)


class EngineCounters:
    """Counts what the engine did; ``snapshot`` adds rates and the scheduler's cache figures."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.num_steps = 0
        self.busy_time_s = 0.0  # time spent inside step()
        self.prompt_tokens = 0  # prompt tokens of requests that produced their first token
        self.generation_tokens = 0  # tokens sampled
        self.prefill_tokens_computed = 0  # prompt positions forwarded (recomputes included)
        self.scheduled_tokens = 0  # every token forwarded
        self.num_finished = 0
        self.num_errors = 0

    def record_step(self, duration_s: float, scheduled_tokens: int, prefill_tokens: int) -> None:
        self.num_steps += 1
        self.busy_time_s += duration_s
        self.scheduled_tokens += scheduled_tokens
        self.prefill_tokens_computed += prefill_tokens

    def snapshot(
        self,
        *,
        prefix_cache_queries: int,
        prefix_cache_hits: int,
        num_preemptions: int,
        kv_blocks_total: int,
        kv_blocks_free: int,
        num_waiting: int,
        num_running: int,
        speculative_decoding: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        busy = self.busy_time_s
        return {
            "num_steps": self.num_steps,
            "busy_time_s": busy,
            "uptime_s": time.monotonic() - self.started,
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "prompt_tokens_per_s": self.prompt_tokens / busy if busy else 0.0,
            "generation_tokens_per_s": self.generation_tokens / busy if busy else 0.0,
            "prefill_tokens_computed": self.prefill_tokens_computed,
            "scheduled_tokens": self.scheduled_tokens,
            "prefix_cache_queries": prefix_cache_queries,
            "prefix_cache_hits": prefix_cache_hits,
            "prefix_cache_hit_rate": prefix_cache_hits / prefix_cache_queries
            if prefix_cache_queries
            else 0.0,
            "num_preemptions": num_preemptions,
            "kv_blocks_total": kv_blocks_total,
            "kv_blocks_free": kv_blocks_free,
            "kv_blocks_used": kv_blocks_total - kv_blocks_free,
            "num_waiting": num_waiting,
            "num_running": num_running,
            "num_finished": self.num_finished,
            "num_errors": self.num_errors,
            # None when speculation is not configured (engine/speculative/stats.py otherwise).
            "speculative_decoding": speculative_decoding,
        }
