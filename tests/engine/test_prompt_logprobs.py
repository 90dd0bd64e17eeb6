"""prompt_logprobs: every prompt token's log-probability (and top-k) from the prefill itself, equal to
transformers' own log-softmax of its logits, whatever the chunking, cache or batch around it."""

from __future__ import annotations

import pytest
import torch

from bulkinfer.engine import LLM, SamplingParams
from bulkinfer.engine.config import EngineConfig
from bulkinfer.engine.llm_engine import LLMEngine
from tests.engine.hf_reference import hf_model
from tests.engine.test_llm_correctness import PROMPTS

ARCHS = ["llama", "qwen2", "qwen3", "mistral", "gemma3", "phi3"]
# bf16: two correct implementations round differently through every layer. Measured on the tiny
# checkpoints (70-token prompt): the engine vs transformers, both in bf16, differ by at most 0.095
# nats per token (mean 0.026); transformers' own bf16 differs from its fp32 by up to 0.275 (mean
# 0.055), the engine's bf16 from that fp32 by up to 0.25 (mean 0.062). Bounds with room for other CPUs:
BF16_TOLERANCE = 0.15
BF16_MEAN_TOLERANCE = 0.05
LONG_PROMPT = [(7 * i + 3) % 500 + 5 for i in range(70)]  # 70 tokens: 4 full blocks of 16 and a part


def hf_prompt_logprobs(model_dir: str, prompt: list[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: transformers' log-softmax before each prompt token after the first."""
    with torch.inference_mode():
        logits = hf_model(model_dir, dtype)(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits[:-1], dim=-1)


def assert_prompt_logprobs(output, reference: torch.Tensor, k: int, tolerance: float) -> None:
    prompt = output.prompt_token_ids
    scored = output.prompt_logprobs
    assert scored is not None and len(scored) == len(prompt) and scored[0] is None
    for i, position in enumerate(scored[1:]):
        token = prompt[i + 1]
        assert position.chosen.token_id == token
        assert position.chosen.logprob == pytest.approx(float(reference[i, token]), abs=tolerance)
        # Rank: 1 + the tokens more likely; tokens within the tolerance of it may count either way.
        value = reference[i, token]
        surely_above = int((reference[i] > value + tolerance).sum())
        maybe_above = int((reference[i] > value - tolerance).sum()) - 1
        assert surely_above + 1 <= position.chosen.rank <= maybe_above + 1
        assert len(position.top) == k
        if tolerance <= 1e-4:
            top = reference[i].topk(k)
            assert [t.token_id for t in position.top] == top.indices.tolist()
            assert [t.logprob for t in position.top] == pytest.approx(top.values.tolist(), abs=tolerance)
        assert [t.rank for t in position.top] == list(range(1, k + 1))


@pytest.mark.parametrize("arch", ARCHS)
def test_fp32_equals_transformers_with_chunked_prefill_in_a_batch(arch, checkpoint_factory):
    """Chunks of 16 split every prompt; four requests share each step, two of them generating."""
    model_dir = str(checkpoint_factory(arch=arch))
    llm = LLM(model=model_dir, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16)
    prompts = [LONG_PROMPT, PROMPTS[1], PROMPTS[12], PROMPTS[4]]
    params = [
        SamplingParams(temperature=0.0, max_tokens=0, prompt_logprobs=5),
        SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=0),
        SamplingParams(temperature=0.0, max_tokens=4),
        SamplingParams(temperature=0.0, max_tokens=0, prompt_logprobs=2),
    ]
    outputs = llm.generate(prompts, params)
    for output, p in zip(outputs, params, strict=True):
        if p.prompt_logprobs is None:
            assert output.prompt_logprobs is None
            continue
        reference = hf_prompt_logprobs(model_dir, output.prompt_token_ids)
        assert_prompt_logprobs(output, reference, p.prompt_logprobs, 1e-4)
    # Scoring changes nothing generated: the same tokens as without it.
    [plain] = llm.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=4))
    assert outputs[1].token_ids == plain.token_ids and len(plain.token_ids) == 4


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_within_tolerance_of_transformers_bf16(arch, checkpoint_factory):
    model_dir = str(checkpoint_factory(arch=arch))
    llm = LLM(model=model_dir, dtype="bfloat16", num_kv_blocks=64, max_num_batched_tokens=32)
    [output] = llm.generate([LONG_PROMPT], SamplingParams(temperature=0.0, max_tokens=0, prompt_logprobs=3))
    reference = hf_prompt_logprobs(model_dir, LONG_PROMPT, torch.bfloat16)
    assert_prompt_logprobs(output, reference, 3, BF16_TOLERANCE)
    got = torch.tensor([p.chosen.logprob for p in output.prompt_logprobs[1:]])
    expected = reference[torch.arange(len(LONG_PROMPT) - 1), torch.tensor(LONG_PROMPT[1:])]
    assert float((got - expected).abs().mean()) <= BF16_MEAN_TOLERANCE


@pytest.fixture(scope="module")
def llm(tiny_checkpoint) -> LLM:
    return LLM(model=str(tiny_checkpoint), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=32)


def test_max_tokens_zero_scores_only(llm):
    [output] = llm.generate([PROMPTS[3]], SamplingParams(max_tokens=0, prompt_logprobs=1))
    assert output.finish_reason == "length" and output.error is None
    assert output.token_ids == [] and output.text == "" and output.num_completion_tokens == 0
    assert len(output.prompt_logprobs) == len(PROMPTS[3])


def test_a_cached_prefix_is_recomputed_for_scoring_and_stays_cached_for_others(llm, tiny_checkpoint):
    """A prompt in the prefix cache has KV but no logits: the scoring request recomputes it (no
    hit), gets every position, and the prefix stays served from the cache for requests that do not score."""
    llm.engine.scheduler.reset_prefix_cache()
    prompt = LONG_PROMPT[:-3] + [11, 12, 13]
    [warm] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))
    [scored] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2))
    [again] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))
    assert warm.num_cached_tokens == 0 and again.num_cached_tokens == 64
    assert scored.num_cached_tokens == 0
    assert_prompt_logprobs(scored, hf_prompt_logprobs(str(tiny_checkpoint), prompt), 2, 1e-4)
    assert scored.token_ids == warm.token_ids == again.token_ids


def test_n_samples_share_one_scoring(llm, tiny_checkpoint):
    [output] = llm.generate([PROMPTS[2]], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=3,
                                                         prompt_logprobs=1))
    assert len(output.outputs) == 3
    assert_prompt_logprobs(output, hf_prompt_logprobs(str(tiny_checkpoint), PROMPTS[2]), 1, 1e-4)


def test_preemption_neither_repeats_nor_loses_positions(tiny_checkpoint):
    """A pool too small for all: requests are preempted mid-prompt and after it, and recomputed
    (hitting their own cached blocks where those were scored already)."""
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint), dtype="float32", num_kv_blocks=14,
                                    max_num_batched_tokens=24, kv_growth_reserve_tokens=0))
    prompts = [LONG_PROMPT[i:] + LONG_PROMPT[:i] for i in (0, 9, 21)]
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                                          prompt_logprobs=1))
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step())
    assert engine.scheduler.num_preemptions > 0
    for i, prompt in enumerate(prompts):
        output = outputs[str(i)]
        assert output.error is None and len(output.token_ids) == 40
        assert_prompt_logprobs(output, hf_prompt_logprobs(str(tiny_checkpoint), prompt), 1, 1e-4)
