"""Pure decode steps through the native layer driver (engine/models/native_decode.py) give exactly
the bits of the Python path: the same greedy tokens and the same logprobs, in fp32 and bf16, with
biases (Qwen2), q/k norms (Qwen3), sparse MoE layers (Qwen3-MoE, Mixtral, Qwen2-MoE's shared expert),
and with shared-prefix groups (bf16: the prefix kernel, where the CPU has one; fp32: the causal
kernel). Models it does not fit (sliding windows) keep the Python path."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import MistralConfig

from bulkinfer.engine import LLM, SamplingParams, cpu_kernels
from bulkinfer.engine.attention import TorchPagedAttention
from bulkinfer.engine.cpu_features import cpu_flags, has_amx
from bulkinfer.engine.models.loader import load_model
from bulkinfer.engine.models.native_decode import NativeDecode
from tests.engine.test_model_vs_transformers import SMALL, save_random_model


def prompts_with_a_shared_instruction(seed: int = 3, vocab: int = 8192) -> list[list[int]]:
    """20 rows under one 208-token instruction (a decode group: bf16 on the prefix kernel, fp32 on the
    causal kernel) and 4 rows of their own, of varied lengths."""
    rng = random.Random(seed)
    instruction = [rng.randrange(5, vocab) for _ in range(208)]
    shared = [instruction + [rng.randrange(5, vocab) for _ in range(rng.randrange(1, 30))]
              for _ in range(20)]
    return shared + [[rng.randrange(5, vocab) for _ in range(n)] for n in (3, 17, 40, 90)]


def native_runs(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts of the steps the native path ran, and of those with shared-prefix groups."""
    counts = {"steps": 0, "with_groups": 0}
    native = llm.engine.model.native_decode
    run, prefix = native.run, native._prefix_batches

    def counting_run(*args, **kwargs):
        result = run(*args, **kwargs)
        counts["steps"] += result is not None
        return result

    def counting_prefix(*args, **kwargs):
        counts["with_groups"] += 1
        return prefix(*args, **kwargs)

    monkeypatch.setattr(native, "run", counting_run)
    monkeypatch.setattr(native, "_prefix_batches", counting_prefix)
    return counts


# (arch, preset): the MoE families where their widths fit the bf16 row kernel (multiples of 32) at the
# smallest size: tiny Mixtral and Qwen2-MoE (its shared expert), small Qwen3-MoE (q/k norms, as dense
# Qwen3 has them, and a dense layer among sparse ones).
MODELS = [("llama", "small"), ("qwen2", "small"), ("qwen3_moe", "small"),
          ("mixtral", "tiny"), ("qwen2_moe", "tiny")]


@pytest.mark.parametrize("arch, preset", MODELS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_native_decode_gives_the_python_paths_tokens_and_logprobs(checkpoint_factory, monkeypatch, arch: str,
                                                                  preset: str, dtype: str) -> None:
    model_dir = str(checkpoint_factory(arch=arch, preset=preset))
    # Cascade groups (off by default on CPU: batch_invariant) through both paths too.
    native = LLM(model=model_dir, dtype=dtype, num_kv_blocks=512, batch_invariant=False)
    kernels = native.engine.model.layers[0].self_attn.backend.kernels
    if kernels is None or native.engine.dtype_choice.torch_dtype not in kernels.row_gemm_dtypes:
        # Without the row kernel for this dtype on this CPU the native path does not apply.
        assert native.engine.model.native_decode is None
        return
    assert native.engine.model.native_decode is not None
    python = LLM(model=model_dir, dtype=dtype, num_kv_blocks=512, batch_invariant=False)
    python.engine.model.native_decode = None
    counts = native_runs(native, monkeypatch)
    config = native.engine.model.config
    prompts = prompts_with_a_shared_instruction(vocab=config.vocab_size)
    tokens = 24 if preset == "small" and arch in ("llama", "qwen2") else 12  # the MoE cases: the suite's time
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, logprobs=3)
    ours, theirs = native.generate(prompts, params), python.generate(prompts, params)
    for a, b in zip(ours, theirs, strict=True):
        assert a.token_ids == b.token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs  # every logprob to the last bit
    assert counts["steps"] >= tokens - 4
    torch_dtype = native.engine.dtype_choice.torch_dtype
    groups_here = (kernels.supports_prefix_attention(torch_dtype, config.head_dim, 16)
                   or kernels.supports_causal_attention(torch_dtype, config.head_dim))
    if groups_here:
        assert counts["with_groups"] > 0  # the rows under the instruction decoded as a group


def test_moe_native_decode_on_the_dot_product_build_gives_the_python_paths_bits(
        checkpoint_factory, monkeypatch) -> None:
    """The kernels built without AMX (what AMD Zen 4/5 run: bf16 on AVX512-BF16's dot product): the
    sparse layers' experts, router and shared expert take that build's row kernel in both paths.
    On a CPU without AMX, -march=native has no AMX to take away: that build is the uncapped native
    one (the same target, the same library bytes), which the engine's cache already holds."""
    no_amx = ["-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"]
    flags = [*cpu_kernels.FLAGS, *(no_amx if has_amx(cpu_flags()) else [])]
    built = cpu_kernels.build_and_open(cpu_kernels._compiler(), cpu_kernels.cache_dir(), flags)
    assert built is not None
    monkeypatch.setattr(cpu_kernels, "load", lambda: built)
    model_dir = str(checkpoint_factory(arch="qwen2_moe", preset="tiny"))
    native = LLM(model=model_dir, dtype="bfloat16", num_kv_blocks=256)
    if torch.bfloat16 not in built.row_gemm_dtypes:  # an AVX2-only CPU: no bf16 row kernel at all
        assert native.engine.model.native_decode is None
        return
    assert built.row_gemm_bf16_kind == "avx512_bf16" and native.engine.model.native_decode is not None
    python = LLM(model=model_dir, dtype="bfloat16", num_kv_blocks=256)
    python.engine.model.native_decode = None
    counts = native_runs(native, monkeypatch)
    prompts = prompts_with_a_shared_instruction(vocab=native.engine.model.config.vocab_size)[-8:]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    for a, b in zip(native.generate(prompts, params), python.generate(prompts, params), strict=True):
        assert a.token_ids == b.token_ids and a.outputs[0].logprobs == b.outputs[0].logprobs
    assert counts["steps"] >= 10


def test_models_it_does_not_fit_keep_the_python_path(checkpoint_factory, tmp_path) -> None:
    """A sliding window is not in the native driver."""
    window = MistralConfig(**SMALL, sliding_window=8, architectures=["MistralForCausalLM"])
    kernels = cpu_kernels.load()
    for model_dir in (save_random_model(window, tmp_path / "window"),):
        model = load_model(model_dir, TorchPagedAttention(kernels=kernels))
        model.use_cpu_kernels(kernels)
        assert model.native_decode is None


def test_dense_qwen3s_q_k_norms_take_the_native_path(checkpoint_factory) -> None:
    """Its per-head q/k norms run in decode_layers.c (the bits: the Qwen3-MoE case above)."""
    kernels = cpu_kernels.load()
    model = load_model(checkpoint_factory(arch="qwen3"), TorchPagedAttention(kernels=kernels))
    model.use_cpu_kernels(kernels)
    fits = kernels is not None and torch.float32 in kernels.row_gemm_dtypes
    assert (model.native_decode is not None) == fits


def test_turning_the_kernels_off_turns_the_native_path_off(tiny_checkpoint) -> None:
    llm = LLM(model=str(tiny_checkpoint), dtype="float32", num_kv_blocks=64)
    llm.engine.model.use_cpu_kernels(None)
    assert llm.engine.model.native_decode is None
    assert NativeDecode.for_model(llm.engine.model, None) is None
