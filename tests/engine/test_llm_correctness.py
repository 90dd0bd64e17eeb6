"""Greedy output of the engine == transformers' greedy output on the same weights, exactly.

Every scenario runs on every supported architecture, with tiny fp32 checkpoints. The reference
for each prompt is transformers ``generate`` on that prompt alone (no padding). The only accepted
difference is a proven fp32 tie (see ``hf_reference.assert_same_greedy``).
"""

from __future__ import annotations

import random

import pytest

from engine import LLM, EngineConfig, LLMEngine, SamplingParams
from tests.engine.hf_reference import assert_same_greedy, hf_greedy

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]
MAX_NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)


def make_prompts(vocab_size: int = 2048, seed: int = 0) -> list[list[int]]:
    """18 prompts of varied lengths; 10 of them share one of two 4-block prefixes (long enough for
    the attention backend to attend them as shared prefixes while those requests decode)."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(5, vocab_size) for _ in range(n)]  # ids 0-4 are special tokens

    shared_a, shared_b = tokens(72), tokens(66)
    prompts = [shared_a + tokens(n) for n in (1, 7, 16, 25, 3)]
    prompts += [shared_b + tokens(n) for n in (2, 15, 31, 9, 12)]
    prompts += [tokens(n) for n in (1, 2, 5, 16, 17, 32, 47, 64)]
    return prompts


PROMPTS = make_prompts()


@pytest.fixture(scope="module", params=ARCHS)
def arch_dir(request, checkpoint_factory) -> str:
    return str(checkpoint_factory(arch=request.param))


def assert_all_match(model_dir: str, llm_or_engine, prompts: list[list[int]], outputs) -> None:
    engine = getattr(llm_or_engine, "engine", llm_or_engine)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.error is None, output.error
        reference = hf_greedy(model_dir, prompt, MAX_NEW_TOKENS)
        assert_same_greedy(output.token_ids, reference, prompt, model_dir, engine.model)


def test_single_request(arch_dir):
    llm = LLM(model=arch_dir, num_kv_blocks=64)
    [output] = llm.generate([PROMPTS[0]], GREEDY)
    assert output.num_completion_tokens == len(output.token_ids) > 0
    assert_all_match(arch_dir, llm, [PROMPTS[0]], [output])


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_many_requests_together(arch_dir, prefix_caching):
    llm = LLM(model=arch_dir, num_kv_blocks=256, enable_prefix_caching=prefix_caching)
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [o.prompt_token_ids for o in outputs] == PROMPTS
    assert_all_match(arch_dir, llm, PROMPTS, outputs)
    metrics = llm.get_metrics()
    if prefix_caching:
        assert metrics["prefix_cache_hits"] > 0
        assert sum(o.num_cached_tokens for o in outputs) > 0
        assert metrics["prefill_tokens_computed"] < sum(map(len, PROMPTS))
    else:
        assert metrics["prefix_cache_hits"] == 0
        assert metrics["prefill_tokens_computed"] == sum(map(len, PROMPTS))


def test_chunked_prefill_with_tiny_token_budget(arch_dir):
    llm = LLM(model=arch_dir, num_kv_blocks=256, max_num_batched_tokens=7)
    outputs = llm.generate(PROMPTS, GREEDY)
    assert_all_match(arch_dir, llm, PROMPTS, outputs)


def test_requests_added_while_others_decode(arch_dir):
    engine = LLMEngine(EngineConfig(model=arch_dir, num_kv_blocks=256, max_num_batched_tokens=64))
    finished = {}
    waves = [PROMPTS[0:4], PROMPTS[4:11], PROMPTS[11:]]
    next_id = 0
    for wave in waves:
        for prompt in wave:
            engine.add_request(str(next_id), prompt, GREEDY)
            next_id += 1
        for _ in range(3):  # a few steps: earlier waves are decoding when the next one arrives
            finished.update({o.request_id: o for o in engine.step()})
    assert engine.scheduler.num_running > 0  # the last wave really overlapped with decoding
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step()})
    outputs = [finished[str(i)] for i in range(len(PROMPTS))]
    assert_all_match(arch_dir, engine, PROMPTS, outputs)


def test_preemption_with_small_kv_pool(arch_dir):
    # 14 usable blocks of 16 tokens for 18 requests of up to 105 tokens: requests must be preempted.
    llm = LLM(model=arch_dir, num_kv_blocks=15)
    outputs = llm.generate(PROMPTS, GREEDY)
    assert llm.get_metrics()["num_preemptions"] > 0
    assert_all_match(arch_dir, llm, PROMPTS, outputs)


def test_priority_scheduling(arch_dir):
    engine = LLMEngine(
        EngineConfig(model=arch_dir, num_kv_blocks=256, scheduling_policy="priority", max_num_seqs=4)
    )
    priorities = [len(PROMPTS) - i for i in range(len(PROMPTS))]  # the last prompt is the most urgent
    for i, (prompt, priority) in enumerate(zip(PROMPTS, priorities, strict=True)):
        engine.add_request(str(i), prompt, GREEDY, priority=priority)
    finish_order = []
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            finish_order.append(int(output.request_id))
            finished[output.request_id] = output
    # Only the 4 most urgent requests run first, so the first to finish is one of them.
    assert finish_order[0] in range(len(PROMPTS) - 4, len(PROMPTS))
    outputs = [finished[str(i)] for i in range(len(PROMPTS))]
    assert_all_match(arch_dir, engine, PROMPTS, outputs)


def test_string_prompts_are_tokenized_and_detokenized(tiny_checkpoint):
    llm = LLM(model=str(tiny_checkpoint), num_kv_blocks=64)
    prompt = "def fibonacci(n):\n    return"
    [output] = llm.generate(prompt, GREEDY)
    token_ids = llm.tokenizer.encode(prompt)
    assert output.prompt == prompt and output.prompt_token_ids == token_ids
    assert output.text == llm.tokenizer.decode(output.token_ids, skip_special_tokens=True)
    assert_all_match(str(tiny_checkpoint), llm, [token_ids], [output])
