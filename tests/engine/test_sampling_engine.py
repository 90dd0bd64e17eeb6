"""Sampling through the whole engine: seeds reproduce whatever the batch, penalties match transformers."""

from __future__ import annotations

import pytest

from bulkinfer.engine import LLM, SamplingParams
from tests.engine.hf_reference import hf_generate
from tests.engine.test_llm_correctness import PROMPTS

SEEDED = [
    SamplingParams(temperature=1.0, seed=42, max_tokens=10, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=-3, max_tokens=10, ignore_eos=True),
    SamplingParams(
        temperature=1.2, min_p=0.01, presence_penalty=0.5, seed=2**70, max_tokens=10, ignore_eos=True
    ),
]


def seeded_alone(model: str, dtype: str = "float32", **config) -> list[list[int]]:
    llm = LLM(model=model, dtype=dtype, num_kv_blocks=256, **config)
    return [llm.generate([PROMPTS[2]], p)[0].token_ids for p in SEEDED]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # bf16: batch invariance (issue 45)
def test_seeded_requests_reproduce_alone_in_a_crowd_and_with_another_token_budget(tiny_checkpoint, dtype):
    model = str(tiny_checkpoint)
    alone = seeded_alone(model, dtype)
    assert all(len(set(tokens)) > 1 for tokens in alone)

    llm = LLM(model=model, dtype=dtype, num_kv_blocks=256)
    crowd = [PROMPTS[i] for i in range(10)]
    others = [SamplingParams(temperature=0.9, max_tokens=10 + i, ignore_eos=True) for i in range(10)]
    outputs = llm.generate(crowd[:4] + [PROMPTS[2]] * 3 + crowd[4:], others[:4] + SEEDED + others[4:])
    assert [o.token_ids for o in outputs[4:7]] == alone

    # Chunked prefill in small pieces: other step boundaries, same tokens.
    assert seeded_alone(model, dtype, max_num_batched_tokens=9) == alone


def test_unseeded_requests_are_reproducible_per_engine_seed(tiny_checkpoint):
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)

    def run(seed: int) -> list[list[int]]:
        llm = LLM(model=str(tiny_checkpoint), dtype="float32", num_kv_blocks=128, seed=seed)
        return [o.token_ids for o in llm.generate(PROMPTS[:3], params)]

    first = run(0)
    assert run(0) == first
    assert run(1) != first
    assert len({tuple(t) for t in first}) == 3


@pytest.mark.parametrize("penalty", [1.5, 0.7])
def test_repetition_penalty_greedy_matches_transformers(tiny_checkpoint, penalty):
    llm = LLM(model=str(tiny_checkpoint), dtype="float32", num_kv_blocks=128)
    prompts = [PROMPTS[11], PROMPTS[13]]
    params = SamplingParams(temperature=0.0, repetition_penalty=penalty, max_tokens=12, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    plain = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert [o.token_ids for o in outputs] != [o.token_ids for o in plain]  # the penalty did something
    for prompt, output in zip(prompts, outputs, strict=True):
        reference = hf_generate(tiny_checkpoint, prompt, 12, repetition_penalty=penalty, min_new_tokens=12)
        assert output.token_ids == reference


def test_top_k_1_and_tiny_top_p_sample_the_greedy_tokens(tiny_checkpoint):
    llm = LLM(model=str(tiny_checkpoint), dtype="float32", num_kv_blocks=128)
    greedy = llm.generate(PROMPTS[:4], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    for params in (
        SamplingParams(temperature=1.5, top_k=1, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=1.0, min_p=1.0, max_tokens=8, ignore_eos=True),
    ):
        outputs = llm.generate(PROMPTS[:4], params)
        assert [o.token_ids for o in outputs] == [o.token_ids for o in greedy]
