"""When speculation pays: a cost curve measured on this machine, the acceptance seen so far, and
each request's own back-off.

Verifying k drafts for each of b running requests costs one forward of b x (1 + k) positions
instead of b; it pays when the tokens it yields per request, 1 + a + a^2 + ... + a^k at a
per-draft acceptance a, exceed that cost ratio. The engine measures both forwards at start-up
for a range of batch sizes (decode rows versus verification rows, lm_head included), so the
switch-off point is this machine's and this model's, not a constant: on a GPU verification is
nearly free until the batch fills the chip, on a 2-core CPU it costs almost its tokens.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from bulkinfer.engine.speculative.config import SpeculativeConfig

# Measured batch sizes (capped at max_num_seqs) and the context each row reads.
MEASURED_BATCHES = (1, 4, 16, 64)  # log-interpolated between; the last ratio holds above
MEASURE_CONTEXT = 64
PRIOR_ACCEPTANCE = 0.5  # before any verification: try it, the measurement corrects it fast
ACCEPTANCE_EMA = 0.05  # weight of one verification step in the running acceptance
MARGIN = 1.05  # speculate only when the expected gain beats the cost by this much
PROBE_EVERY = 16  # steps between probes while off (acceptance may have grown)
PROBE_REQUESTS = 4  # requests that draft in a probe step: enough to measure, too few to cost much
MAX_SKIP_STEPS = 32  # longest pause of a request whose drafts keep failing


@dataclass(frozen=True)
class CostCurve:
    """Seconds of a decode step and of a verification step (k drafts per row), by batch size."""

    batches: tuple[int, ...]
    decode_s: tuple[float, ...]
    verify_s: tuple[float, ...]
    num_drafts: int

    def ratio(self, batch: int) -> float:
        """verify / decode seconds at `batch` rows (interpolated in log batch; clamped at the ends)."""
        ratios = [v / d for v, d in zip(self.verify_s, self.decode_s, strict=True)]
        if batch <= self.batches[0]:
            return ratios[0]
        if batch >= self.batches[-1]:
            return ratios[-1]
        i = bisect.bisect_right(self.batches, batch)
        lo, hi = self.batches[i - 1], self.batches[i]
        w = (math.log(batch) - math.log(lo)) / (math.log(hi) - math.log(lo))
        return ratios[i - 1] * (1 - w) + ratios[i] * w

    def as_dict(self) -> dict[str, object]:
        return {"batches": list(self.batches), "decode_s": list(self.decode_s),
                "verify_s": list(self.verify_s), "num_drafts": self.num_drafts}


# rows: list of (tokens per row, context per row); returns after the forward and lm_head.
ForwardProbe = Callable[[int, int, int], None]


def measure_cost_curve(forward: ForwardProbe, num_drafts: int, max_batch: int) -> CostCurve:
    """Time `forward(batch, tokens_per_row, context)` for decodes (1 token) and verifications
    (1 + num_drafts tokens) at each measured batch size up to `max_batch`; best of two runs
    after a warm-up."""
    batches = tuple(b for b in MEASURED_BATCHES if b <= max_batch) or (1,)
    forward(1, 1 + num_drafts, MEASURE_CONTEXT)  # warm-up: first-call costs out of the figures
    decode, verify = [], []
    for batch in batches:
        decode.append(_best_of(2, partial(forward, batch, 1, MEASURE_CONTEXT)))
        verify.append(_best_of(2, partial(forward, batch, 1 + num_drafts, MEASURE_CONTEXT)))
    return CostCurve(batches, tuple(decode), tuple(verify), num_drafts)


def _best_of(runs: int, fn: Callable[[], None]) -> float:
    best = math.inf
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return max(best, 1e-9)


def expected_tokens(acceptance: float, num_drafts: int) -> float:
    """Tokens one verification yields when each draft is accepted with probability `acceptance`
    (given the ones before it were)."""
    a = min(max(acceptance, 0.0), 1.0)
    return float(num_drafts + 1) if a >= 1.0 else (1 - a ** (num_drafts + 1)) / (1 - a)


@dataclass
class RequestDrafting:
    """One request's proposal length and back-off."""

    num_drafts: int
    misses: int = 0  # verifications in a row that accepted nothing at length 1
    resume_step: int = 0  # no drafts before this step


@dataclass
class SpeculationGate:
    """Decides each step whether requests propose drafts, and how many each."""

    config: SpeculativeConfig
    curve: CostCurve | None = None  # None with disable_by_batch_size set (or not measurable)
    acceptance: float = PRIOR_ACCEPTANCE
    _requests: dict[str, RequestDrafting] = field(default_factory=dict)
    _step: int = 0
    _off_steps: int = 0

    def proposers(self, num_running: int) -> int:
        """How many of the running requests may propose drafts this step (0: speculation is off);
        called once per step."""
        self._step += 1
        if self._pays(num_running):
            self._off_steps = 0
            return num_running
        self._off_steps += 1
        # While off, an occasional probe by a few requests re-measures acceptance, unless even
        # perfect acceptance could not pay at this batch size.
        k = self.config.num_speculative_tokens
        worth_probing = self.curve is not None and self.curve.ratio(num_running) * MARGIN < k + 1
        if worth_probing and self._off_steps % PROBE_EVERY == 0:
            return min(num_running, PROBE_REQUESTS)
        return 0

    def break_even_batch(self) -> int | None:
        """The largest measured batch at which speculation pays at the acceptance seen so far."""
        if self.config.disable_by_batch_size is not None:
            return self.config.disable_by_batch_size
        if self.curve is None:
            return None
        paying = [b for b in self.curve.batches if self._pays(b)]
        return max(paying) if paying else 0

    def num_drafts(self, request_id: str) -> int:
        """How many drafts this request proposes now (0 while it backs off)."""
        state = self._requests.get(request_id)
        if state is None:
            state = self._requests[request_id] = RequestDrafting(self.config.num_speculative_tokens)
        return state.num_drafts if self._step >= state.resume_step else 0

    def record(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """A verification's outcome: the request's next length, and the running acceptance."""
        if num_drafts <= 0:
            return
        self.acceptance += ACCEPTANCE_EMA * (num_accepted / num_drafts - self.acceptance)
        state = self._requests.get(request_id)
        if state is None:
            return
        most = self.config.num_speculative_tokens
        if num_accepted == num_drafts:
            state.num_drafts = min(most, num_drafts + 1)
            state.misses = 0
        elif num_accepted > 0:
            state.num_drafts = num_accepted + 1
            state.misses = 0
        else:
            state.num_drafts = 1
            state.misses += 1
            state.resume_step = self._step + min(MAX_SKIP_STEPS, 2 ** state.misses) if state.misses > 1 else 0

    def release(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def _pays(self, num_running: int) -> bool:
        limit = self.config.disable_by_batch_size
        if limit is not None:
            return num_running <= limit
        if self.curve is None:
            return False
        k = self.config.num_speculative_tokens
        return expected_tokens(self.acceptance, k) > self.curve.ratio(num_running) * MARGIN


def cost_curve_or_none(config: SpeculativeConfig, forward: ForwardProbe, max_batch: int,
                       can_measure: bool) -> CostCurve | None:
    """The measured curve, unless a fixed batch limit makes it moot or the KV pool is too small."""
    if config.disable_by_batch_size is not None or not can_measure:
        return None
    return measure_cost_curve(forward, config.num_speculative_tokens, max_batch)
