"""Batch invariance and the prefix cache (issue 45): a prompt that repeats another row's prompt and
answer (a follow-up turn, a row built from an earlier output) gets the bits it gets alone. The
answer's K/V came from the decode kernel, a prompt's from prefill: with batch invariance on, only
blocks wholly inside a prompt are cached, so the follow-up computes the answer's positions itself."""

from __future__ import annotations

import random

import pytest

from bulkinfer.engine import EngineConfig, LLMEngine, SamplingParams

RNG = random.Random(451)
FIRST_PROMPT = [RNG.randrange(5, 2000) for _ in range(40)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)


def _engine(model: str, dtype: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, dtype=dtype, kv_populate_seconds=0, num_kv_blocks=64))


def _run(engine: LLMEngine, request_id: str, prompt: list[int]) -> tuple:
    engine.add_request(request_id, prompt, GREEDY)
    result = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                completion = output.outputs[0]
                logprobs = tuple((p.chosen.logprob, tuple(t.logprob for t in p.top))
                                 for p in completion.logprobs)
                result = (tuple(completion.token_ids), logprobs)
    assert result is not None
    return result


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_prompt_holding_an_earlier_rows_answer_gets_its_bits_alone(checkpoint_factory, dtype: str) -> None:
    model = str(checkpoint_factory(arch="llama"))
    engine = _engine(model, dtype)
    first_answer = _run(engine, "first", FIRST_PROMPT)[0]
    follow_up = FIRST_PROMPT + list(first_answer) + [11, 12, 13, 14, 15]
    hits_before = engine.get_metrics()["prefix_cache_hits"]
    after_first = _run(engine, "follow-up", follow_up)
    # The first row's prompt blocks were reused (2 of 16 tokens), its answer's were not.
    assert engine.get_metrics()["prefix_cache_hits"] - hits_before == 2 * 16
    assert after_first == _run(_engine(model, dtype), "alone", follow_up)
