"""Batched sampling: greedy, temperature, top-k, top-p, and per-request seeds independent of the batch."""

from __future__ import annotations

import torch

from engine import LLM, SamplingParams
from engine.sampler import Sampler, SamplingBatch, request_generator
from tests.engine.test_llm_correctness import PROMPTS


def sample(logits: torch.Tensor, params: list[SamplingParams], sampler: Sampler | None = None) -> list[int]:
    generators = [request_generator(p.seed) for p in params]
    return (sampler or Sampler()).sample(logits, SamplingBatch.build(params, generators))


def test_greedy_is_argmax():
    logits = torch.randn(5, 100, generator=torch.Generator().manual_seed(0))
    assert sample(logits, [SamplingParams(temperature=0.0)] * 5) == logits.argmax(-1).tolist()


def test_greedy_rows_stay_greedy_in_a_mixed_batch():
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.5) for i in range(6)]
    tokens = sample(logits, params)
    assert tokens[1::2] == logits[1::2].argmax(-1).tolist()


def test_temperature_sampling_follows_the_softmax():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    rows = 20000
    logits = (probs.log() * 2.0).expand(rows, -1)  # temperature 2 undoes the factor 2
    tokens = torch.tensor(sample(logits, [SamplingParams(temperature=2.0)] * rows))
    frequencies = torch.bincount(tokens, minlength=4).float() / rows
    torch.testing.assert_close(frequencies, probs, atol=0.015, rtol=0)


def test_top_k_and_top_p_restrict_the_candidates():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    rows = 4000
    logits = probs.log().expand(rows, -1)
    top_k = sample(logits, [SamplingParams(temperature=1.0, top_k=2)] * rows)
    assert set(top_k) == {0, 1}
    # top_p=0.6: token 1 stays (0.5 before it), token 2 goes (0.8 before it).
    top_p = sample(logits, [SamplingParams(temperature=1.0, top_p=0.6)] * rows)
    assert set(top_p) == {0, 1}
    only_top = sample(logits[:50], [SamplingParams(temperature=1.0, top_p=0.1)] * 50)
    assert set(only_top) == {0}
    mixed = sample(
        logits[:3],
        [
            SamplingParams(temperature=1.0, top_k=1),
            SamplingParams(temperature=0.0),
            SamplingParams(top_p=0.4),
        ],
    )
    assert mixed == [0, 0, 0]


def test_seeded_rows_do_not_depend_on_batch_composition():
    gen = torch.Generator().manual_seed(3)
    target = torch.randn(1, 300, generator=gen)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)

    def seeded_tokens(batch_size: int, position: int, steps: int = 20) -> list[int]:
        others = torch.randn(batch_size, 300, generator=gen)
        params = [SamplingParams(temperature=0.7) for _ in range(batch_size)]
        params[position] = seeded
        generators = [request_generator(p.seed) for p in params]
        sampler = Sampler(seed=batch_size)
        tokens = []
        for _ in range(steps):
            logits = others.clone()
            logits[position] = target[0]
            tokens.append(sampler.sample(logits, SamplingBatch.build(params, generators))[position])
        return tokens

    alone = seeded_tokens(1, 0)
    assert len(set(alone)) > 1  # really random, not greedy
    assert seeded_tokens(7, 3) == alone
    assert seeded_tokens(16, 15) == alone


def test_seeded_request_in_the_engine_is_independent_of_its_neighbours(tiny_checkpoint):
    llm = LLM(model=str(tiny_checkpoint), num_kv_blocks=128)
    seeded = SamplingParams(temperature=1.0, top_k=50, seed=7, max_tokens=12, ignore_eos=True)
    other = SamplingParams(temperature=0.9, max_tokens=12, ignore_eos=True)
    [alone] = llm.generate([PROMPTS[3]], seeded)
    crowd = llm.generate([PROMPTS[0], PROMPTS[3], PROMPTS[9], PROMPTS[14]], [other, seeded, other, other])
    assert crowd[1].token_ids == alone.token_ids
    again = llm.generate([PROMPTS[3]], SamplingParams(temperature=1.0, top_k=50, seed=8, max_tokens=12))
    assert again[0].token_ids != alone.token_ids  # the seed matters
