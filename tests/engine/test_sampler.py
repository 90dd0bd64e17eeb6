"""Batched sampler on known logits: greedy, temperature, top-k/top-p/min-p, penalties, min_tokens,
logprobs, grammar bitmask, and counter-based seeds that ignore the batch."""

from __future__ import annotations

import math

import pytest
import torch

from bulkinfer.engine import LLM, SamplingParams
from bulkinfer.engine.request import Request
from bulkinfer.engine.sampler import Sampler, SamplingBatch
from bulkinfer.engine.sampling_random import split_seed, uniforms
from tests.engine.test_llm_correctness import PROMPTS

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])


def row(params: SamplingParams, seed: int = 0, index: int = 0, prompt=(1,), output=()) -> Request:
    request = Request("r", list(prompt), params, sample_seed=seed, sample_index=index)
    for token in output:
        request.append_output_token(token, 0.0)
    return request


def sample(logits: torch.Tensor, rows: list[Request], eos: int | None = None) -> list[int]:
    return Sampler().sample(logits.clone(), SamplingBatch.build(rows, eos)).token_ids


def draws(logits_row: torch.Tensor, params: SamplingParams, count: int) -> torch.Tensor:
    """`count` draws from one distribution: one row per seed."""
    rows = [row(params, seed=s) for s in range(count)]
    return torch.tensor(sample(logits_row.expand(count, -1), rows))


def frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).float() / len(tokens)


# ---- randomness -----------------------------------------------------------------------------------


def test_uniforms_are_uniform_and_keyed_by_seed_index_and_position():
    n = 50_000
    zeros = torch.zeros(n, dtype=torch.int64)
    u = uniforms(zeros + 7, zeros, zeros, torch.arange(n))
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0
    histogram = torch.histc(u, bins=10, min=0.0, max=1.0) / n
    torch.testing.assert_close(histogram, torch.full((10,), 0.1), atol=0.01, rtol=0)
    lag1 = torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1]
    assert abs(float(lag1)) < 0.02
    # Every key component changes the draw.
    base = uniforms(zeros[:1] + 7, zeros[:1], zeros[:1], zeros[:1])
    for changed in (
        uniforms(zeros[:1] + 8, zeros[:1], zeros[:1], zeros[:1]),
        uniforms(zeros[:1] + 7, zeros[:1] + 1, zeros[:1], zeros[:1]),
        uniforms(zeros[:1] + 7, zeros[:1], zeros[:1] + 1, zeros[:1]),
        uniforms(zeros[:1] + 7, zeros[:1], zeros[:1], zeros[:1] + 1),
    ):
        assert float(changed) != float(base)


def test_split_seed_takes_any_int_modulo_2_64():
    assert split_seed(0) == (0, 0)
    assert split_seed((5 << 32) | 9) == (9, 5)
    assert split_seed(-1) == (0xFFFFFFFF, 0xFFFFFFFF)
    assert split_seed(1 << 64) == (0, 0)


def test_a_row_depends_only_on_its_seed_index_position_and_logits():
    gen = torch.Generator().manual_seed(3)
    target = torch.randn(300, generator=gen)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)

    def tokens(batch_size: int, position: int, mates: SamplingParams) -> list[int]:
        out = []
        for step in range(20):
            logits = torch.randn(batch_size, 300, generator=gen)
            logits[position] = target
            rows = [row(mates, seed=100 + i, output=[5] * step) for i in range(batch_size)]
            rows[position] = row(seeded, seed=1234, output=[5] * step)
            out.append(sample(logits, rows)[position])
        return out

    alone = tokens(1, 0, seeded)
    assert len(set(alone)) > 1  # really random, not greedy
    assert tokens(7, 3, SamplingParams(temperature=0.7)) == alone
    assert tokens(16, 15, SamplingParams(temperature=0.0)) == alone
    # Batch mates that need a sort (top-k + top-p) or penalties change nothing either.
    assert tokens(5, 2, SamplingParams(temperature=1.3, top_k=5, top_p=0.5, presence_penalty=1.0)) == alone
    # A different sample index is a different stream.
    other_index = [
        sample(target[None], [row(seeded, seed=1234, index=1, output=[5] * s)])[0] for s in range(20)
    ]
    assert other_index != alone


# ---- greedy and temperature -----------------------------------------------------------------------


def test_greedy_is_argmax():
    logits = torch.randn(5, 100, generator=torch.Generator().manual_seed(0))
    assert sample(logits, [row(SamplingParams(temperature=0.0))] * 5) == logits.argmax(-1).tolist()


def test_greedy_rows_stay_greedy_in_a_mixed_batch():
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(1))
    rows = [row(SamplingParams(temperature=0.0 if i % 2 else 1.5), seed=i) for i in range(6)]
    assert sample(logits, rows)[1::2] == logits[1::2].argmax(-1).tolist()


def test_temperature_sampling_follows_the_softmax():
    logits = PROBS.log() * 2.0  # temperature 2 undoes the factor 2
    freq = frequencies(draws(logits, SamplingParams(temperature=2.0), 20_000), 4)
    torch.testing.assert_close(freq, PROBS, atol=0.015, rtol=0)


def test_low_temperature_sharpens_and_tiny_temperature_is_greedy():
    logits = PROBS.log()
    sharp = frequencies(draws(logits, SamplingParams(temperature=0.5), 10_000), 4)
    expected = PROBS**2 / (PROBS**2).sum()
    torch.testing.assert_close(sharp, expected, atol=0.015, rtol=0)
    assert set(draws(logits, SamplingParams(temperature=1e-7), 200).tolist()) == {0}


# ---- filters --------------------------------------------------------------------------------------


def test_top_k_keeps_the_k_best_in_proportion():
    freq = frequencies(draws(PROBS.log(), SamplingParams(top_k=2), 20_000), 4)
    torch.testing.assert_close(freq, torch.tensor([0.625, 0.375, 0.0, 0.0]), atol=0.015, rtol=0)


def test_top_p_keeps_the_smallest_set_reaching_p():
    # top_p=0.6: token 1 stays (0.5 before it), token 2 goes (0.8 before it).
    freq = frequencies(draws(PROBS.log(), SamplingParams(top_p=0.6), 20_000), 4)
    torch.testing.assert_close(freq, torch.tensor([0.625, 0.375, 0.0, 0.0]), atol=0.015, rtol=0)
    assert set(draws(PROBS.log(), SamplingParams(top_p=0.1), 200).tolist()) == {0}
    # 0.85: three tokens (0.8 before the third).
    assert set(draws(PROBS.log(), SamplingParams(top_p=0.85), 2000).tolist()) == {0, 1, 2}


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    # min_p=0.35: keeps p >= 0.175 -> tokens 0 and 1.
    freq = frequencies(draws(PROBS.log(), SamplingParams(min_p=0.35), 20_000), 4)
    torch.testing.assert_close(freq, torch.tensor([0.625, 0.375, 0.0, 0.0]), atol=0.015, rtol=0)
    # After temperature: at T=2 p ~ sqrt(PROBS); min_p=0.5 keeps sqrt(p)/sqrt(0.5) >= 0.5 -> 0,1,2.
    kept = set(draws(PROBS.log(), SamplingParams(temperature=2.0, min_p=0.5), 3000).tolist())
    assert kept == {0, 1, 2}


def test_filters_combine_per_row_in_one_batch():
    logits = PROBS.log().expand(4, -1)
    rows = [
        row(SamplingParams(top_k=1), seed=1),
        row(SamplingParams(temperature=0.0), seed=2),
        row(SamplingParams(top_p=0.4), seed=3),
        row(SamplingParams(top_k=3, top_p=0.99, min_p=0.2), seed=4),
    ]
    for seed in range(200):
        rows[3].sample_seed = seed
        tokens = sample(logits, rows)
        assert tokens[:3] == [0, 0, 0]
        assert tokens[3] in (0, 1, 2)


def test_top_k_larger_than_the_vocabulary_keeps_everything():
    tokens = draws(PROBS.log(), SamplingParams(top_k=100, top_p=0.999), 5000)
    assert set(tokens.tolist()) == {0, 1, 2, 3}


# ---- penalties ------------------------------------------------------------------------------------


def test_presence_and_frequency_penalties_follow_openai():
    logits = torch.zeros(1, 6)
    params = SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25, logprobs=0)
    r = row(params, prompt=[4, 4, 4], output=[1, 2, 2])
    batch = SamplingBatch.build([r])
    processed = logits.clone()
    Sampler().sample(processed, batch)
    # Output counts: token 1 once, token 2 twice; prompt tokens never count for these penalties.
    expected = torch.tensor([[0.0, -0.75, -1.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(processed, expected)


def test_presence_penalty_steers_away_from_used_tokens_and_negative_attracts():
    logits = torch.tensor([[2.0, 1.9, 0.5]])
    assert sample(logits, [row(SamplingParams(temperature=0.0, presence_penalty=0.5), output=[0])]) == [1]
    assert sample(logits, [row(SamplingParams(temperature=0.0, presence_penalty=-2.0), output=[2])]) == [2]
    base = frequencies(draws(logits[0], SamplingParams(), 5000), 3)
    rows = [row(SamplingParams(frequency_penalty=1.0), seed=s, output=[0, 0]) for s in range(5000)]
    penalized = frequencies(torch.tensor(sample(logits.expand(5000, -1), rows)), 3)
    assert penalized[0] < base[0] - 0.2 and penalized[1] > base[1]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, -1.0, 3.0, -2.0, 0.5]])
    r = row(SamplingParams(temperature=0.0, repetition_penalty=2.0), prompt=[0], output=[1])
    processed = logits.clone()
    Sampler().sample(processed, SamplingBatch.build([r]))
    torch.testing.assert_close(processed, torch.tensor([[1.0, -2.0, 3.0, -2.0, 0.5]]))


def test_repetition_penalty_matches_transformers():
    from transformers import RepetitionPenaltyLogitsProcessor

    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 50, generator=gen)
    histories = [[1, 2, 3, 3], [10, 49, 0], [7]]
    rows = [
        row(SamplingParams(temperature=0.0, repetition_penalty=1.3), prompt=h[:2], output=h[2:])
        for h in histories
    ]
    processed = logits.clone()
    Sampler().sample(processed, SamplingBatch.build(rows))
    for i, history in enumerate(histories):
        reference = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([history]), logits[i : i + 1].clone())
        torch.testing.assert_close(processed[i : i + 1], reference)


def test_rows_without_penalties_are_untouched_in_a_penalized_batch():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(2))
    rows = [
        row(SamplingParams(temperature=0.0), output=[1, 2]),
        row(SamplingParams(temperature=0.0, repetition_penalty=1.5), output=[1, 2]),
        row(SamplingParams(temperature=0.0), output=[3]),
    ]
    processed = logits.clone()
    Sampler().sample(processed, SamplingBatch.build(rows))
    torch.testing.assert_close(processed[[0, 2]], logits[[0, 2]])


# ---- min_tokens, bitmask, logprobs ----------------------------------------------------------------


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0]])  # EOS = 1, stop id 2
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[2])
    assert sample(logits, [row(params, output=[])], eos=1) == [3]
    assert sample(logits, [row(params, output=[3])], eos=1) == [3]
    assert sample(logits, [row(params, output=[3, 3])], eos=1) == [1]  # reached: EOS allowed
    ignoring = SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True)
    assert sample(logits, [row(ignoring)], eos=1) == [1]  # EOS ends nothing, so it is not masked


def test_min_tokens_yields_where_the_grammar_allows_only_the_end():
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0], [0.0, 5.0, 4.0, 3.0]])  # EOS = 1
    bitmask = torch.tensor([[0b0010], [0b1010]], dtype=torch.int32)  # row 0: EOS only; row 1: EOS or 3

    def apply(target: torch.Tensor, mask: torch.Tensor) -> None:
        allowed = (mask[:, :1] >> torch.arange(4)) & 1
        target.masked_fill_(allowed == 0, float("-inf"))

    params = SamplingParams(temperature=0.0, min_tokens=3)
    rows = [row(params), row(params)]
    batch = SamplingBatch.build(rows, eos_token_id=1, bitmask=bitmask, apply_bitmask=apply)
    # Row 0 must end (masking EOS would leave no token); row 1 still has a token other than EOS.
    assert Sampler().sample(logits.clone(), batch).token_ids == [1, 3]


def test_grammar_bitmask_is_applied_before_everything():
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0], [5.0, 4.0, 3.0, 2.0]])
    bitmask = torch.tensor([[0b1100], [-1]], dtype=torch.int32)  # row 0: tokens 2, 3 only

    def apply(target: torch.Tensor, mask: torch.Tensor) -> None:
        allowed = (mask[:, :1] >> torch.arange(4)) & 1
        target.masked_fill_(allowed == 0, float("-inf"))

    rows = [row(SamplingParams(temperature=0.0, logprobs=1)), row(SamplingParams(temperature=0.0))]
    out = Sampler().sample(logits.clone(), SamplingBatch.build(rows, bitmask=bitmask, apply_bitmask=apply))
    assert out.token_ids == [2, 0]
    # Logprobs are the model's, before the mask.
    raw = torch.log_softmax(logits[0], -1)
    assert out.logprobs[0].chosen == pytest.approx(float(raw[2]))
    assert out.logprobs[0].top_ids == [0]


def test_logprobs_are_the_raw_log_softmax_with_the_top_k():
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(4))
    rows = [
        row(SamplingParams(temperature=0.8, logprobs=5, presence_penalty=2.0), seed=1, output=[0]),
        row(SamplingParams(temperature=0.0)),
        row(SamplingParams(temperature=0.0, logprobs=0)),
    ]
    out = Sampler().sample(logits.clone(), SamplingBatch.build(rows))
    assert out.logprobs[1] is None
    for i in (0, 2):
        raw = torch.log_softmax(logits[i], -1)
        lp = out.logprobs[i]
        assert lp.token_id == out.token_ids[i]
        assert lp.chosen == pytest.approx(float(raw[out.token_ids[i]]), abs=1e-6)
        k = rows[i].sampling_params.logprobs
        top = raw.topk(k) if k else None
        assert lp.top_ids == (top.indices.tolist() if k else [])
        assert lp.top_logprobs == pytest.approx(top.values.tolist() if k else [])
        assert math.isclose(sum(math.exp(v) for v in raw.tolist()), 1.0, rel_tol=1e-5)


# ---- in the engine --------------------------------------------------------------------------------


def test_seeded_request_in_the_engine_is_independent_of_its_neighbours(tiny_checkpoint):
    llm = LLM(model=str(tiny_checkpoint), dtype="float32", num_kv_blocks=128)
    seeded = SamplingParams(temperature=1.0, top_k=50, seed=7, max_tokens=12, ignore_eos=True)
    other = SamplingParams(temperature=0.9, max_tokens=12, ignore_eos=True)
    [alone] = llm.generate([PROMPTS[3]], seeded)
    crowd = llm.generate([PROMPTS[0], PROMPTS[3], PROMPTS[9], PROMPTS[14]], [other, seeded, other, other])
    assert crowd[1].token_ids == alone.token_ids
    again = llm.generate([PROMPTS[3]], SamplingParams(temperature=1.0, top_k=50, seed=8, max_tokens=12))
    assert again[0].token_ids != alone.token_ids  # the seed matters


# ---- what crosses to the host ---------------------------------------------------------------------


@pytest.mark.parametrize("with_logprobs", [False, True])
def test_a_step_reads_the_device_once_and_logprobs_once_more(monkeypatch, with_logprobs):
    """Sampling with every option on (temperature, top-k, top-p, min-p, penalties, min_tokens, a NaN
    row) reads nothing back from the device but one copy of the sampled ids and flags, and one of
    the logprob values where asked: a GPU step waits for the device once, not per option."""
    reads: list[str] = []
    copies: list[int] = []
    inside = []
    for name in ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "nonzero"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            if not inside:
                reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    original_cpu = torch.Tensor.cpu

    def cpu(self, *args, **kwargs):
        copies.append(self.numel())
        inside.append(True)  # what is read from the host copy is not a device read
        return original_cpu(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "cpu", cpu)
    logprobs = 2 if with_logprobs else None
    rows = [
        row(SamplingParams(temperature=0.0, logprobs=logprobs)),
        row(SamplingParams(temperature=0.8, top_k=2, seed=1, logprobs=logprobs)),
        row(SamplingParams(temperature=1.0, top_p=0.9, min_p=0.1, seed=2)),
        row(SamplingParams(temperature=0.0, presence_penalty=0.5, repetition_penalty=1.3), output=[1, 2]),
        row(SamplingParams(temperature=0.7, min_tokens=3, seed=3), output=[1]),
        row(SamplingParams(temperature=0.0)),
    ]
    logits = PROBS.log().repeat(len(rows), 1)
    logits[5, 2] = float("nan")
    batch = SamplingBatch.build(rows, eos_token_id=3)
    output = Sampler().sample(logits, batch)
    assert reads == [] and len(copies) == (2 if with_logprobs else 1)
    assert output.invalid_rows == [5] and output.token_ids[0] == 0
    assert (output.logprobs[0] is not None) is with_logprobs
