"""LoRA rows through the engine's other paths: the prefix cache (hits within an adapter only),
native decode (LoRA steps run there too, with the PyTorch layers' bits), the fixed-shape decode path
(LoRA steps take the PyTorch layers, the other steps keep it), speculative decoding (the target
verifies with the row's adapter) and structured output."""

from __future__ import annotations

import random
import re

import pytest

from bulkinfer.engine import LLM, LoRARequest, SamplingParams
from bulkinfer.engine.decode_graphs import DecodeGraphs
from tests.engine.hf_reference import hf_greedy
from tests.engine.lora_adapters import make_adapter
from tests.engine.test_speculative import ALWAYS, NGRAM, copy_heavy_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def base_dir(checkpoint_factory) -> str:
    return str(checkpoint_factory(arch="llama"))


@pytest.fixture(scope="module")
def adapters(base_dir) -> list[tuple[LoRARequest, str]]:
    """Two adapters (LoRARequest, merged reference folder)."""
    made = [make_adapter(base_dir, seed) for seed in (21, 22)]
    return [(LoRARequest(f"a{i}", i + 1, str(adapter)), str(merged))
            for i, (adapter, merged) in enumerate(made)]


@pytest.fixture(scope="module")
def small_base(checkpoint_factory) -> tuple[str, list[tuple[LoRARequest, str]]]:
    """A base whose widths fit the bf16 row kernel (whole 32-wide tiles), and two adapters of it."""
    base = str(checkpoint_factory(arch="llama", preset="small"))
    made = [make_adapter(base, seed) for seed in (23, 24)]
    return base, [(LoRARequest(f"s{i}", i + 1, str(adapter)), str(merged))
                  for i, (adapter, merged) in enumerate(made)]


def lora_llm(base_dir: str, dtype: str = "float32", **options) -> LLM:
    return LLM(model=base_dir, dtype=dtype, num_kv_blocks=128, enable_lora=True, max_loras=2, **options)


def prompt(seed: int, n: int = 40) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 2048) for _ in range(n)]


def test_prefix_cache_hits_within_an_adapter_and_never_across_adapters_or_with_the_base(base_dir, adapters):
    llm = lora_llm(base_dir)
    (a, merged_a), (b, merged_b) = adapters
    shared = prompt(1, 48)  # three full blocks

    def run(lora):
        [output] = llm.generate([shared], GREEDY, lora_request=lora)
        return output

    first_a = run(a)
    assert first_a.num_cached_tokens == 0
    again_a = run(a)
    assert again_a.num_cached_tokens >= 32 and again_a.token_ids == first_a.token_ids
    assert run(None).num_cached_tokens == 0  # the base never reads adapter a's KV
    first_b = run(b)
    assert first_b.num_cached_tokens == 0  # nor does another adapter
    assert run(None).num_cached_tokens >= 32  # the base hits its own
    assert run(b).num_cached_tokens >= 32
    assert first_a.token_ids == hf_greedy(merged_a, shared, GREEDY.max_tokens)
    assert first_b.token_ids == hf_greedy(merged_b, shared, GREEDY.max_tokens)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_native_decode_runs_lora_steps_with_the_python_paths_bits(small_base, monkeypatch, dtype):
    """Steps with rows of two adapters and the base take the native decode path (the updates in
    decode_layers.c), and give the tokens and every logprob the PyTorch layers give."""
    base_dir, adapters = small_base
    native_llm = lora_llm(base_dir, dtype=dtype)
    native = native_llm.engine.model.native_decode
    kernels = native_llm.engine.model.layers[0].self_attn.backend.kernels
    if kernels is None or native_llm.engine.dtype_choice.torch_dtype not in kernels.row_gemm_dtypes:
        # Without the row kernel for this dtype on this CPU (AVX2-only; bf16 without AMX or
        # AVX512-BF16) the native path does not apply: every step takes the PyTorch layers.
        assert native is None
        return
    assert native is not None and native.has_lora
    python_llm = lora_llm(base_dir, dtype=dtype)
    python_llm.engine.model.native_decode = None
    runs = []
    run = native.run

    def counting(*args, **kwargs):
        result = run(*args, **kwargs)
        runs.append(result is not None and args[4] is not None)  # a step with LoRA rows, run natively
        return result

    monkeypatch.setattr(native, "run", counting)
    (a, merged_a), (b, merged_b) = adapters
    prompts = [prompt(2), prompt(3), prompt(6, 25), prompt(7, 9), prompt(8, 31)]
    loras = [a, None, b, a, b]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    ours = native_llm.generate(prompts, params, lora_request=loras)
    theirs = python_llm.generate(prompts, params, lora_request=loras)
    assert sum(runs) >= params.max_tokens - 2
    for mine, reference in zip(ours, theirs, strict=True):
        assert mine.token_ids == reference.token_ids
        assert mine.outputs[0].logprobs == reference.outputs[0].logprobs  # to the last bit
    if dtype == "float32":
        assert ours[0].token_ids == hf_greedy(merged_a, prompts[0], params.max_tokens)
        assert ours[2].token_ids == hf_greedy(merged_b, prompts[2], params.max_tokens)


def test_the_fixed_shape_decode_path_runs_base_steps_and_not_lora_steps(base_dir, adapters, monkeypatch):
    llm = lora_llm(base_dir, decode_graphs=True)
    runs = []
    run = DecodeGraphs.run

    def counting(self, *args, **kwargs):
        result = run(self, *args, **kwargs)
        runs.append(result is not None)
        return result

    monkeypatch.setattr(DecodeGraphs, "run", counting)
    prompts = [prompt(4), prompt(5)]
    llm.generate(prompts, GREEDY)
    assert sum(runs) >= GREEDY.max_tokens - 2
    runs.clear()
    (a, merged_a), (b, merged_b) = adapters
    outputs = llm.generate(prompts, GREEDY, lora_request=[a, b])
    assert not runs
    assert outputs[0].token_ids == hf_greedy(merged_a, prompts[0], GREEDY.max_tokens)
    assert outputs[1].token_ids == hf_greedy(merged_b, prompts[1], GREEDY.max_tokens)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_gives_the_adapters_tokens(base_dir, adapters, method):
    prompts = copy_heavy_prompts()
    (a, _), (b, _) = adapters
    loras = [a, b, None, a]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    plain = lora_llm(base_dir).generate(prompts, params, lora_request=loras)
    # The draft is the base model without adapters: rows of an adapter reject some of its drafts.
    spec = NGRAM if method == "ngram" else {"method": "draft_model", "model": base_dir,
                                            "num_speculative_tokens": 3, **ALWAYS}
    llm = lora_llm(base_dir, speculative_config=spec)
    outputs = llm.generate(prompts, params, lora_request=loras)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]
    stats = llm.get_metrics()["speculative_decoding"]
    assert stats["num_draft_tokens"] > 0
    if method == "draft_model":
        assert 0 < stats["acceptance_rate"] < 1.0


def test_structured_output_holds_on_lora_rows(base_dir, adapters):
    llm = lora_llm(base_dir)
    (a, _), (b, _) = adapters
    choices = ["alpha", "beta", "gamma delta"]
    regex = r"[a-c]{3}-[0-9]{2}"
    params = [SamplingParams(choice=choices, max_tokens=16), SamplingParams(regex=regex, max_tokens=16)]
    outputs = llm.generate([prompt(6), prompt(7), prompt(8)], [params[0], params[1], params[0]],
                           lora_request=[a, b, None])
    assert outputs[0].text in choices and outputs[2].text in choices
    assert re.fullmatch(regex, outputs[1].text)
    assert [o.lora_name for o in outputs] == ["a0", "a1", None]


def test_a_lora_rows_tokens_and_logprobs_do_not_depend_on_its_neighbours(small_base):
    """Batch invariance (on by default on CPU) holds for adapter rows: a row alone, among rows of
    other adapters and the base, and with its prefill chunked, gets the same bits."""
    base_dir, adapters = small_base
    (a, _), (b, _) = adapters
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    # Alone the target's prompt is one small matmul's rows; in the crowd its adapter's rows number
    # hundreds (oneDNN's bf16 GEMM takes another kernel there, which rounds differently).
    target, others = prompt(11, 20), [prompt(12 + i, 60 + 7 * i) for i in range(8)]
    loras = [a, a, a, b, None, a, a, b]

    def run(llm, crowd):
        prompts, requests = ([target, *others], [a, *loras]) if crowd else ([target], [a])
        output = llm.generate(prompts, params, lora_request=requests)[0]
        return output.token_ids, output.outputs[0].logprobs

    whole = lora_llm(base_dir, dtype="bfloat16")
    chunked = lora_llm(base_dir, dtype="bfloat16", max_num_batched_tokens=17, enable_prefix_caching=False)
    alone = run(whole, crowd=False)
    assert run(whole, crowd=True) == alone
    assert run(chunked, crowd=True) == alone
