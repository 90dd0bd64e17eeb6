"""Greedy output of the engine == transformers' greedy output on the same weights.

Every scenario runs on every supported architecture, with tiny checkpoints, in fp32 and in bf16.
fp32: the reference for each prompt is transformers ``generate`` on that prompt alone (no
padding), and the only accepted difference is a proven fp32 tie (``hf_reference.assert_same_greedy``).
bf16: 32 tokens per prompt, each checked against transformers in bf16 on the same context; at least
95% must be its argmax and every other one a proven bf16 near-tie
(``hf_reference.assert_greedy_within_noise``).
"""

from __future__ import annotations

import random

import pytest
import torch

from bulkinfer.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from bulkinfer.engine.dtype_choice import cpu_flags
from tests.engine.hf_reference import (
    TEST_DEVICE,
    assert_greedy_by_teacher_forcing,
    assert_greedy_within_noise,
    assert_same_greedy,
    hf_greedy,
)

ARCHS = ["llama", "qwen2", "qwen3", "mistral", "gemma3", "phi3"]
DTYPES = ["float32", "bfloat16"]
# The newer families run every scenario in fp32 and show bf16 agreement where all of prefix
# caching, batching and the shared-prefix paths meet (suite time: each scenario is seconds per arch).
NEWER_FAMILIES = {"gemma3", "phi3"}
BF16_SCENARIOS_FOR_ALL = {"test_many_requests_together"}
MAX_NEW_TOKENS = {"float32": 8, "bfloat16": 32, "float16": 32}


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


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """`arch` x `dtype` for the scenarios (see NEWER_FAMILIES), `dtype` alone elsewhere; a test that
    parametrizes `arch` itself (the MoE scenario) gets `dtype` only."""
    given = set()
    for marker in metafunc.definition.iter_markers("parametrize"):
        argnames = marker.args[0]
        given |= set(argnames.replace(" ", "").split(",") if isinstance(argnames, str) else argnames)
    names = [name for name in metafunc.fixturenames if name not in given]
    if "arch" in names and "dtype" in names:
        every_dtype = metafunc.function.__name__ in BF16_SCENARIOS_FOR_ALL
        pairs = [(arch, dtype) for arch in ARCHS for dtype in DTYPES
                 if every_dtype or dtype == "float32" or arch not in NEWER_FAMILIES]
        metafunc.parametrize(("arch", "dtype"), pairs, ids=[f"{a}-{d}" for a, d in pairs], scope="module")
    elif "arch" in names:
        metafunc.parametrize("arch", ARCHS, scope="module")
    elif "dtype" in names:
        metafunc.parametrize("dtype", DTYPES)


@pytest.fixture(scope="module")
def arch_dir(arch, checkpoint_factory) -> str:
    return str(checkpoint_factory(arch=arch))


def greedy(dtype: str) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS[dtype])


GREEDY = greedy("float32")


def assert_all_match(model_dir: str, llm_or_engine, prompts: list[list[int]], outputs) -> None:
    engine = getattr(llm_or_engine, "engine", llm_or_engine)
    dtype = engine.dtype_choice.dtype
    for output in outputs:
        assert output.error is None, output.error
    if dtype != "float32":
        pairs = [(prompt, output.token_ids) for prompt, output in zip(prompts, outputs, strict=True)]
        assert_greedy_within_noise(pairs, model_dir, engine.model, getattr(torch, dtype))
        return
    for prompt, output in zip(prompts, outputs, strict=True):
        reference = hf_greedy(model_dir, prompt, MAX_NEW_TOKENS[dtype])
        assert_same_greedy(output.token_ids, reference, prompt, model_dir, engine.model)


def test_single_request(arch_dir, dtype):
    llm = LLM(model=arch_dir, device=TEST_DEVICE, num_kv_blocks=64, dtype=dtype)
    [output] = llm.generate([PROMPTS[0]], greedy(dtype))
    assert output.num_completion_tokens == len(output.token_ids) > 0
    assert_all_match(arch_dir, llm, [PROMPTS[0]], [output])


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_many_requests_together(arch_dir, prefix_caching, dtype):
    llm = LLM(model=arch_dir, device=TEST_DEVICE, num_kv_blocks=256, enable_prefix_caching=prefix_caching,
              dtype=dtype)
    outputs = llm.generate(PROMPTS, greedy(dtype))
    assert [o.prompt_token_ids for o in outputs] == PROMPTS
    assert_all_match(arch_dir, llm, PROMPTS, outputs)
    metrics = llm.get_metrics()
    # Usage accounting: each step's time is split over its requests by tokens, so the requests'
    # engine seconds add up to the engine's busy time, and a longer prompt is charged more.
    charged = [o.metrics.engine_seconds for o in outputs]
    assert min(charged) > 0 and sum(charged) == pytest.approx(metrics["busy_time_s"], rel=1e-6)
    if prefix_caching:
        assert metrics["prefix_cache_hits"] > 0
        assert sum(o.num_cached_tokens for o in outputs) > 0
        assert metrics["prefill_tokens_computed"] < sum(map(len, PROMPTS))
    else:
        assert metrics["prefix_cache_hits"] == 0
        assert metrics["prefill_tokens_computed"] == sum(map(len, PROMPTS))


@pytest.mark.parametrize("native", [True, False], ids=["native-kernels", "pytorch"])
def test_requests_sharing_an_instruction_prefill_it_once_as_a_cascade(arch_dir, dtype, native, monkeypatch):
    """Rows under one instruction reach prefill together with the instruction cached: its blocks are
    attended once for every query token of them, each row's own part causally on its own."""
    from bulkinfer.engine.attention import TorchPagedAttention

    rng = random.Random(5)
    instruction = [rng.randrange(5, 2048) for _ in range(64)]  # 4 blocks, as long as PROMPTS' prefixes
    tails = (1, 7, 16, 25, 40, 3, 33, 18)
    prompts = [instruction + [rng.randrange(5, 2048) for _ in range(n)] for n in tails]
    groups, causal_calls, causal_in_groups = [], [], []
    original = TorchPagedAttention._prefill_group

    def prefill_group(self, *args):
        groups.append(len(args[-1].chunks))
        before = len(causal_calls)
        result = original(self, *args)
        causal_in_groups.append(len(causal_calls) - before)
        return result

    monkeypatch.setattr(TorchPagedAttention, "_prefill_group", prefill_group)
    # The cascade is off where batch invariance is on (the CPU's default): asked for here.
    llm = LLM(model=arch_dir, device=TEST_DEVICE, num_kv_blocks=256, dtype=dtype, batch_invariant=False)
    kernels = llm.engine.model.layers[0].self_attn.backend.kernels  # one backend for every layer
    if not native:
        llm.engine.model.layers[0].self_attn.backend.kernels = None
    amx_calls = []
    if native and kernels is not None and kernels.supports_prefix_attention(getattr(torch, dtype), 32, 16):
        prefix_attention = kernels.prefix_attention
        monkeypatch.setattr(kernels, "prefix_attention",
                            lambda *args, **kwargs: amx_calls.append(1) or prefix_attention(*args, **kwargs))
    if native and kernels is not None:
        causal_attention = kernels.causal_attention

        def counted_causal_attention(*args, **kwargs):
            causal_calls.append(1)
            return causal_attention(*args, **kwargs)

        monkeypatch.setattr(kernels, "causal_attention", counted_causal_attention)
    outputs = llm.generate(prompts, greedy(dtype))
    assert groups and max(groups) >= 2, "no prefill chunks were attended as a cascade"
    if native and dtype == "bfloat16" and {"amx_bf16", "avx512_bf16"} & cpu_flags() and TEST_DEVICE == "cpu":
        assert amx_calls, "bf16 on an AMX / AVX512-BF16 CPU: the shared blocks go through the prefix kernel"
    head_dim = llm.engine.model.config.head_dim
    if native and kernels is not None and kernels.supports_causal_attention(getattr(torch, dtype), head_dim):
        # fp32: the shared blocks through the causal kernel, straight from the cache (not SDPA)
        assert sum(causal_in_groups) > 0
    assert_all_match(arch_dir, llm, prompts, outputs)


def test_many_requests_together_in_float16(arch_dir):
    # fp16 on a CPU is slow (no native kernels) but runs: tiny models keep it affordable.
    llm = LLM(model=arch_dir, device=TEST_DEVICE, num_kv_blocks=256, dtype="float16")
    outputs = llm.generate(PROMPTS, greedy("float16"))
    assert llm.engine.runner.kv_caches[0].dtype == torch.float16
    assert_all_match(arch_dir, llm, PROMPTS, outputs)


def test_chunked_prefill_with_tiny_token_budget(arch_dir, dtype):
    llm = LLM(model=arch_dir, device=TEST_DEVICE, num_kv_blocks=256, max_num_batched_tokens=7,
              dtype=dtype)
    outputs = llm.generate(PROMPTS, greedy(dtype))
    assert_all_match(arch_dir, llm, PROMPTS, outputs)


def test_requests_added_while_others_decode(arch_dir, dtype):
    engine = LLMEngine(
        EngineConfig(model=arch_dir, device=TEST_DEVICE, num_kv_blocks=256, max_num_batched_tokens=64,
                     dtype=dtype)
    )
    finished = {}
    waves = [PROMPTS[0:4], PROMPTS[4:11], PROMPTS[11:]]
    next_id = 0
    for wave in waves:
        for prompt in wave:
            engine.add_request(str(next_id), prompt, greedy(dtype))
            next_id += 1
        for _ in range(3):  # a few steps: earlier waves are decoding when the next one arrives
            finished.update({o.request_id: o for o in engine.step()})
    assert engine.scheduler.num_running > 0  # the last wave really overlapped with decoding
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step()})
    outputs = [finished[str(i)] for i in range(len(PROMPTS))]
    assert_all_match(arch_dir, engine, PROMPTS, outputs)


def test_preemption_with_small_kv_pool(arch_dir, dtype):
    # 14 usable blocks of 16 tokens for 18 requests of up to 129 tokens, all admitted (no growth
    # reserve): requests must be preempted.
    llm = LLM(model=arch_dir, device=TEST_DEVICE, num_kv_blocks=15, dtype=dtype, kv_growth_reserve_tokens=0)
    outputs = llm.generate(PROMPTS, greedy(dtype))
    assert llm.get_metrics()["num_preemptions"] > 0
    assert_all_match(arch_dir, llm, PROMPTS, outputs)


def test_priority_scheduling(arch_dir, dtype):
    engine = LLMEngine(
        EngineConfig(model=arch_dir, device=TEST_DEVICE, num_kv_blocks=256, scheduling_policy="priority",
                     max_num_seqs=4, dtype=dtype)
    )
    priorities = [len(PROMPTS) - i for i in range(len(PROMPTS))]  # the last prompt is the most urgent
    for i, (prompt, priority) in enumerate(zip(PROMPTS, priorities, strict=True)):
        engine.add_request(str(i), prompt, greedy(dtype), priority=priority)
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
    llm = LLM(model=str(tiny_checkpoint), num_kv_blocks=64, dtype="float32")
    prompt = "def fibonacci(n):\n    return"
    [output] = llm.generate(prompt, GREEDY)
    token_ids = llm.tokenizer.encode(prompt)
    assert output.prompt == prompt and output.prompt_token_ids == token_ids
    assert output.text == llm.tokenizer.decode(output.token_ids, skip_special_tokens=True)
    assert_all_match(str(tiny_checkpoint), llm, [token_ids], [output])


def test_decode_rows_share_an_instruction_only_where_it_pays(checkpoint_factory, dtype, monkeypatch):
    """Decode groups (rows attending a shared instruction once) form only where the measured rule
    says they pay: through the prefix kernel (bf16, AMX / AVX512-BF16) for groups of at least 32
    queries per kv head; beside the native decode kernel without it (fp32), through the causal
    kernel for groups of at least 16 rows that save 3,072 token reads (here 24 rows under 160
    tokens); always on the PyTorch path. Outputs match transformers either way."""
    from bulkinfer.engine.attention import (
        CAUSAL_CASCADE_MIN_ROWS,
        NO_GROUP,
        PREFIX_KERNEL_MIN_QUERIES,
        TorchPagedAttention,
    )

    model_dir = str(checkpoint_factory(arch="llama"))
    rng = random.Random(11)
    instruction = [rng.randrange(5, 2048) for _ in range(160)]
    prompts = [instruction + [rng.randrange(5, 2048) for _ in range(1 + i % 9)] for i in range(24)]
    # The eager path's plan (a GPU's default fixed-shape decode steps never group rows).
    # Shared-prefix decode groups are a fast path batch invariance (on by default on CPU) turns off.
    llm = LLM(model=model_dir, device=TEST_DEVICE, num_kv_blocks=512, dtype=dtype, decode_graphs=False,
              batch_invariant=False)
    backend = llm.engine.model.layers[0].self_attn.backend
    config = llm.engine.model.config
    queries_per_kv_head = config.num_heads // config.num_kv_heads
    rules, plans = [], []
    original = TorchPagedAttention.decode_plan

    def recorded(self, metadata, sliding_window, num_kv_heads, for_kernel=False, min_rows=2,
                 min_shared_tokens=None):
        rules.append(min_rows)
        plans.append(original(self, metadata, sliding_window, num_kv_heads, for_kernel, min_rows,
                              min_shared_tokens))
        return plans[-1]

    monkeypatch.setattr(TorchPagedAttention, "decode_plan", recorded)
    outputs = llm.generate(prompts, greedy(dtype))
    sizes = [len(prefix.rows) for plan in plans for prefix in plan.shared_prefixes]
    kernels = backend.kernels if TEST_DEVICE == "cpu" else None
    cache = llm.engine.runner.kv_caches[0]
    if kernels is None or not kernels.supports(cache.dtype, cache.shape[-1], cache.shape[-2]):
        assert set(rules) == {2} and sizes and max(sizes) == 24  # PyTorch path: the whole group
    elif kernels.supports_prefix_attention(cache.dtype, cache.shape[-1], cache.shape[-2]):
        min_rows = -(-PREFIX_KERNEL_MIN_QUERIES // queries_per_kv_head)
        assert set(rules) == {min_rows} and sizes and min(sizes) >= min_rows
    elif kernels.supports_causal_attention(cache.dtype, cache.shape[-1]):
        assert set(rules) == {CAUSAL_CASCADE_MIN_ROWS} and sizes and min(sizes) >= CAUSAL_CASCADE_MIN_ROWS
    else:
        assert set(rules) == {NO_GROUP} and not sizes
    assert_all_match(model_dir, llm, prompts, outputs)


# Mixture-of-experts archs: every scenario above at once in one engine per arch and dtype (the
# suite's time budget), against transformers as above.
MOE_ARCHS = ["qwen3_moe", "mixtral"]
# Both shared prefixes (prefix hits) and prompts of their own, 1 to 103 tokens.
MOE_PROMPTS = PROMPTS[0:4] + PROMPTS[5:8] + PROMPTS[12:17]


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_under_prefix_hits_chunked_prefill_and_preemption(arch, dtype, checkpoint_factory):
    """A pool of 14 usable blocks (preemption), a budget of 24 tokens a step (every 66+-token prompt
    prefills in chunks, beside decodes), the prefix cache on (prompts share 4-block prefixes), and
    requests arriving in two waves, the second while the first decodes."""
    model_dir = str(checkpoint_factory(arch=arch))
    engine = LLMEngine(EngineConfig(model=model_dir, device=TEST_DEVICE, num_kv_blocks=15,
                                    kv_growth_reserve_tokens=0, max_num_batched_tokens=24,
                                    enable_prefix_caching=True, dtype=dtype))
    finished = {}
    for wave in (range(0, 6), range(6, len(MOE_PROMPTS))):
        for i in wave:
            engine.add_request(str(i), MOE_PROMPTS[i], greedy(dtype))
        for _ in range(4):
            finished.update({o.request_id: o for o in engine.step()})
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step()})
    metrics = engine.get_metrics()
    assert metrics["num_preemptions"] > 0 and metrics["prefix_cache_hits"] > 0
    assert metrics["prefill_tokens_computed"] < sum(map(len, MOE_PROMPTS)) + metrics["num_preemptions"] * 200
    outputs = [finished[str(i)] for i in range(len(MOE_PROMPTS))]
    for output in outputs:
        assert output.error is None and len(output.token_ids) == MAX_NEW_TOKENS[dtype]
    pairs = [(prompt, output.token_ids) for prompt, output in zip(MOE_PROMPTS, outputs, strict=True)]
    if dtype == "float32":
        assert_greedy_by_teacher_forcing(pairs, model_dir, engine.model)
    else:
        assert_greedy_within_noise(pairs, model_dir, engine.model, getattr(torch, dtype))
