"""A row's answer never depends on its neighbours (issue 45): its tokens AND logprobs are bitwise
those it gets alone, whatever schedule it runs in: other rows before, beside and after it, sharing
its instruction or not, its prefix from the cache or computed, its prefill chunked at any budget,
speculative decoding on, preempted and recomputed, in fp32 and bf16, for each architecture. A
seeded sampled row is held to the same (the same tokens and logprobs in any schedule).

hypothesis draws the schedules; each example is one engine run, compared with the rows alone."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from bulkinfer.engine import EngineConfig, LLMEngine, SamplingParams, attention

# (arch, dtype): dense llama / qwen3 / gemma3 (sliding window, its own norms) / phi3 (fused
# projections) and a mixture-of-experts model, bf16 for all of them (where invariance was lost) and
# fp32 where the kernels differ (the causal kernel instead of the prefix kernel).
CASES = [("llama", "float32"), ("llama", "bfloat16"), ("qwen3", "bfloat16"), ("qwen3_moe", "bfloat16"),
         ("gemma3", "bfloat16"), ("phi3", "bfloat16")]
# Drawn schedules per case, besides EVERYTHING_AT_ONCE: the suite's time (~1.5 min of CPU in all);
# more for llama bf16, the case every other one builds on.
EXAMPLES = {("llama", "bfloat16"): 3}

RNG = random.Random(45)
VOCAB = 2000
INSTRUCTION = [RNG.randrange(5, VOCAB) for _ in range(40)]  # 2.5 blocks: shared by some rows
SEGMENT = [RNG.randrange(5, VOCAB) for _ in range(6)]  # repeated: prompt lookup finds drafts
TARGET_PROMPTS = [INSTRUCTION + SEGMENT * 3, INSTRUCTION + [RNG.randrange(5, VOCAB) for _ in range(30)]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=2026, max_tokens=14, ignore_eos=True, logprobs=3)
TARGETS = list(zip(TARGET_PROMPTS, (GREEDY, SEEDED), strict=True))
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "disable_by_batch_size": 1024}  # speculating at every batch size, not as the cost gate decides


@dataclass(frozen=True)
class Schedule:
    others: list[tuple[list[int], SamplingParams]]  # rows that are not targets, in arrival order
    target_slots: list[int]  # where each target arrives among the others
    steps_between: int  # engine steps run between arrival waves (rows decoding when others arrive)
    wave_size: int
    warm_cache: bool  # the instruction already cached (a row under it ran before)
    max_num_batched_tokens: int
    num_kv_blocks: int  # few: preemption and recompute
    speculative: bool


@st.composite
def other_rows(draw: st.DrawFn) -> tuple[list[int], SamplingParams]:
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    tail = [rng.randrange(5, VOCAB) for _ in range(draw(st.integers(1, 50)))]
    prompt = INSTRUCTION + tail if draw(st.booleans()) else tail
    greedy = draw(st.booleans())
    params = SamplingParams(temperature=0.0 if greedy else 1.0, max_tokens=draw(st.integers(1, 16)),
                            ignore_eos=True)
    return prompt, params


@st.composite
def schedules(draw: st.DrawFn) -> Schedule:
    others = draw(st.lists(other_rows(), min_size=0, max_size=12))
    return Schedule(
        others=others,
        target_slots=[draw(st.integers(0, len(others))) for _ in TARGETS],
        steps_between=draw(st.integers(0, 3)),
        wave_size=draw(st.integers(1, 8)),
        warm_cache=draw(st.booleans()),
        max_num_batched_tokens=draw(st.sampled_from([5, 16, 17, 33, 64, 4096])),
        num_kv_blocks=draw(st.sampled_from([14, 24, 512])),
        speculative=draw(st.booleans()),
    )


# One schedule with every condition at once (drawn ones may miss some): rows under the target's
# instruction already cached, waves arriving while others decode, a 17-token budget (chunks), a
# 14-block pool (preemption) and n-gram drafts.
_ROWS = random.Random(7)
EVERYTHING_AT_ONCE = Schedule(
    others=[((INSTRUCTION if i % 2 else []) + [_ROWS.randrange(5, VOCAB) for _ in range(5 + 7 * i)],
             SamplingParams(temperature=0.0 if i % 3 else 1.0, max_tokens=6 + i, ignore_eos=True))
            for i in range(8)],
    target_slots=[2, 5], steps_between=2, wave_size=3, warm_cache=True, max_num_batched_tokens=17,
    num_kv_blocks=14, speculative=True)


def _fingerprint(output) -> tuple:
    """A finished row's tokens and every logprob it reported, to compare bit for bit."""
    completion = output.outputs[0]
    return (tuple(completion.token_ids),
            tuple((p.chosen.token_id, p.chosen.logprob, tuple((t.token_id, t.logprob) for t in p.top))
                  for p in completion.logprobs))


def _engine(model: str, dtype: str, **options) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, dtype=dtype, kv_populate_seconds=0, **options))


def _run_alone(model: str, dtype: str, **options) -> list[tuple]:
    results = []
    for prompt, params in TARGETS:
        engine = _engine(model, dtype, num_kv_blocks=64, **options)
        engine.add_request("target", prompt, params)
        results.append(_run_to_end(engine)["target"])
    return results


def _run_to_end(engine: LLMEngine) -> dict[str, tuple]:
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: _fingerprint(o) for o in engine.step() if o.outputs[0].logprobs})
    return finished


def _run_schedule(model: str, dtype: str, schedule: Schedule, **options) -> tuple[dict[str, tuple], dict]:
    """`options`: further EngineConfig fields (a device, batch_invariant), for the run and its warm-up."""
    engine = _engine(model, dtype, num_kv_blocks=schedule.num_kv_blocks, kv_growth_reserve_tokens=0,
                     max_num_batched_tokens=schedule.max_num_batched_tokens,
                     speculative_config=NGRAM if schedule.speculative else None, **options)
    if schedule.warm_cache:
        engine.add_request("warm", INSTRUCTION + [7, 8, 9], SamplingParams(max_tokens=1))
        _run_to_end(engine)
    arrivals: list[tuple[str, list[int], SamplingParams]] = [
        (f"other{i}", prompt, params) for i, (prompt, params) in enumerate(schedule.others)]
    for t, slot in sorted(enumerate(schedule.target_slots), key=lambda item: -item[1]):
        arrivals.insert(slot, (f"target{t}", *TARGETS[t]))
    finished: dict[str, tuple] = {}
    for first in range(0, len(arrivals), schedule.wave_size):
        for request_id, prompt, params in arrivals[first:first + schedule.wave_size]:
            engine.add_request(request_id, prompt, params)
        for _ in range(schedule.steps_between):
            finished.update({o.request_id: _fingerprint(o) for o in engine.step() if o.outputs[0].logprobs})
    finished.update(_run_to_end(engine))
    return finished, engine.get_metrics()


@pytest.fixture
def cascades_at_any_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cascade paths' size thresholds lowered to what these small schedules reach (two rows over
    one shared block), so a schedule would take them if batch invariance let it."""
    monkeypatch.setattr(attention, "PREFIX_KERNEL_MIN_QUERIES", 2)
    monkeypatch.setattr(attention, "CAUSAL_CASCADE_MIN_ROWS", 2)
    monkeypatch.setattr(attention, "CAUSAL_CASCADE_MIN_SAVED_TOKENS", 16)
    init = attention.TorchPagedAttention.__init__
    monkeypatch.setattr(attention.TorchPagedAttention, "__init__",
                        lambda self, **kwargs: init(self, **{"min_shared_tokens": 16, **kwargs}))


@pytest.mark.parametrize("arch, dtype", CASES)
def test_a_rows_tokens_and_logprobs_are_those_it_gets_alone_in_any_schedule(
        checkpoint_factory, cascades_at_any_size, arch: str, dtype: str) -> None:
    check_rows_match_alone(str(checkpoint_factory(arch=arch)), dtype, EXAMPLES.get((arch, dtype), 1))


def check_rows_match_alone(model: str, dtype: str, max_examples: int, **options) -> None:
    """The property: EVERYTHING_AT_ONCE and `max_examples` drawn schedules, each target row's
    fingerprint equal to its own alone; `options` go to every engine (alone ones included)."""
    alone = _run_alone(model, dtype, **options)
    assert len(set(alone[1][0])) > 1  # the seeded row really samples
    seen = {"preempted": 0, "cache hits": 0, "drafts": 0}

    @settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(schedule=schedules())
    @example(schedule=EVERYTHING_AT_ONCE)
    def holds(schedule: Schedule) -> None:
        finished, metrics = _run_schedule(model, dtype, schedule, **options)
        seen["preempted"] += metrics["num_preemptions"]
        seen["cache hits"] += metrics["prefix_cache_hits"]
        seen["drafts"] += (metrics["speculative_decoding"] or {}).get("num_draft_tokens", 0)
        for t in range(len(TARGETS)):
            assert finished[f"target{t}"] == alone[t], f"target {t} ({'greedy' if t == 0 else 'seeded'})"

    holds()
    # The draws really covered the schedules the property is about.
    assert seen["preempted"] > 0 and seen["cache hits"] > 0 and seen["drafts"] > 0, seen


def test_batch_invariance_is_on_by_default_on_cpu_only_and_takes_a_bool() -> None:
    assert EngineConfig(model="m").batch_invariant_on
    assert not EngineConfig(model="m", device="cuda:0").batch_invariant_on
    assert EngineConfig(model="m", device="cuda", batch_invariant=True).batch_invariant_on
    assert not EngineConfig(model="m", batch_invariant=False).batch_invariant_on
    with pytest.raises(ValueError, match="batch_invariant must be true, false or null, got 'yes'"):
        EngineConfig(model="m", batch_invariant="yes").validate()
