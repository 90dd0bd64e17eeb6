"""The adaptive switch: speculate while verification costs less than the tokens it gains."""

from __future__ import annotations

from bulkinfer.engine.speculative.config import SpeculativeConfig
from bulkinfer.engine.speculative.gate import (
    PROBE_EVERY,
    PROBE_REQUESTS,
    CostCurve,
    SpeculationGate,
    expected_tokens,
    measure_cost_curve,
)

CONFIG = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
# Like a 2-core CPU: verification (5 positions per row) costs ~1.2x a decode at 1 row and ~4.5x at 64.
CURVE = CostCurve(batches=(1, 4, 16, 64), decode_s=(0.010, 0.012, 0.020, 0.060),
                  verify_s=(0.012, 0.020, 0.060, 0.270), num_drafts=4)


def test_expected_tokens_per_verification() -> None:
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert abs(expected_tokens(0.5, 4) - (1 + 0.5 + 0.25 + 0.125 + 0.0625)) < 1e-12


def test_speculation_runs_for_the_tail_and_stops_for_a_full_batch() -> None:
    gate = SpeculationGate(CONFIG, CURVE, acceptance=0.6)  # ~2.3 tokens per verification
    assert gate.proposers(1) == 1 and gate.proposers(4) == 4
    assert gate.proposers(64) == 0
    assert gate.break_even_batch() == 4  # 16 rows: ratio 3.0 > 2.3
    # Higher acceptance moves the switch-off point up.
    assert SpeculationGate(CONFIG, CURVE, acceptance=0.95).break_even_batch() == 16


def test_while_off_it_probes_only_where_perfect_acceptance_could_pay() -> None:
    gate = SpeculationGate(CONFIG, CURVE, acceptance=0.1)
    at_16 = [gate.proposers(16) for _ in range(2 * PROBE_EVERY)]
    # Ratio 3 < 5 tokens at best: every PROBE_EVERY steps a probe by PROBE_REQUESTS requests.
    assert at_16.count(0) == 2 * PROBE_EVERY - 2 and at_16.count(PROBE_REQUESTS) == 2
    gate = SpeculationGate(CONFIG, CostCurve((1, 64), (0.01, 0.01), (0.1, 0.1), 4), acceptance=0.1)
    assert not any(gate.proposers(64) for _ in range(3 * PROBE_EVERY))  # 10x the cost: never pays


def test_a_fixed_batch_limit_overrides_the_measurement() -> None:
    gate = SpeculationGate(SpeculativeConfig(disable_by_batch_size=8), None)
    assert gate.proposers(8) == 8 and gate.proposers(9) == 0


def test_each_request_backs_off_when_its_drafts_fail() -> None:
    gate = SpeculationGate(CONFIG, CURVE)
    gate.proposers(1)
    assert gate.num_drafts("r") == 4
    gate.record("r", 4, 4)
    assert gate.num_drafts("r") == 4  # all accepted: stays at the maximum
    gate.record("r", 4, 1)
    assert gate.num_drafts("r") == 2  # one accepted: propose one more than that next time
    gate.record("r", 2, 0)
    assert gate.num_drafts("r") == 1
    gate.record("r", 1, 0)  # a second miss in a row: pause for a few steps
    assert gate.num_drafts("r") == 0
    for _ in range(4):
        gate.proposers(1)
    assert gate.num_drafts("r") == 1
    gate.record("r", 1, 1)
    assert gate.num_drafts("r") == 2


def test_measuring_times_decodes_and_verifications_at_each_batch() -> None:
    calls = []
    curve = measure_cost_curve(lambda batch, tokens, context: calls.append((batch, tokens)), 3, max_batch=16)
    assert curve.batches == (1, 4, 16)
    assert {(b, t) for b, t in calls} == {(b, t) for b in (1, 4, 16) for t in (1, 4)}
    assert len(curve.decode_s) == len(curve.verify_s) == 3
