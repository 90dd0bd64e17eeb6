"""The engine with its attention on the Triton kernels (`triton_kernels=True`): greedy tokens equal to
transformers' in fp32 through prefix-cache hits, chunked prefill continuing after cached blocks, decode
rows beside prefill chunks, Gemma 3's sliding-window layers and the fixed-shape decode path (a CUDA
graph's on a GPU); and batch invariance, a row's logprobs bitwise the same alone and in a batch.

On CPU the kernels run under Triton's interpreter, which is slow (a few ms a program): the scenarios
are small. With BULKINFER_TEST_DEVICE=cuda they run the compiled kernels (and by default there:
test_llm_correctness.py then covers every family and scenario on the Triton path)."""

from __future__ import annotations

import os

if os.environ.get("BULKINFER_TEST_DEVICE", "cpu") != "cuda":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from bulkinfer.engine import LLM, SamplingParams  # noqa: E402
from bulkinfer.engine.gpu_kernels.attention_backend import TritonPagedAttention  # noqa: E402
from bulkinfer.engine.gpu_kernels.layer_ops import TritonLayerOps  # noqa: E402
from tests.engine.hf_reference import TEST_DEVICE, assert_same_greedy, hf_greedy  # noqa: E402

MAX_TOKENS = 3


def prompts(seed: int = 0) -> list[list[int]]:
    """Two prompts sharing a 2-block instruction (longer than Gemma 3's 20-token window), and one
    of its own."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(5, 2048) for _ in range(n)]

    shared = tokens(32)
    return [shared + tokens(n) for n in (3, 9)] + [tokens(21)]


@pytest.fixture(scope="module")
def gemma_dir(checkpoint_factory) -> str:
    return str(checkpoint_factory(arch="gemma3"))


def test_greedy_tokens_equal_transformers_and_rows_keep_their_bits_alone_or_batched(gemma_dir):
    """Batch invariance is on (the CPU default): a row's logprobs are the same bits when it runs again
    alone, its prompt from the cache."""
    llm = LLM(model=gemma_dir, device=TEST_DEVICE, dtype="float32", num_kv_blocks=64, triton_kernels=True,
              max_num_batched_tokens=24, decode_graphs=True, batch_invariant=True)
    assert isinstance(llm.engine.model.layers[0].self_attn.backend, TritonPagedAttention)
    assert isinstance(llm.engine.model.layers[0].self_attn.kernels, TritonLayerOps)  # rotary in Triton too
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=1)
    batch = prompts()
    first = llm.generate(batch[:1], greedy)  # its blocks stay cached: the others hit its prefix
    rest = llm.generate(batch[1:], greedy)
    for prompt, output in zip(batch, first + rest, strict=True):
        assert output.error is None, output.error
        assert_same_greedy(output.token_ids, hf_greedy(gemma_dir, prompt, MAX_TOKENS), prompt, gemma_dir,
                           llm.engine.model)
    assert rest[0].num_cached_tokens >= 32  # the shared instruction came from the cache
    again = llm.generate(batch[2:3], greedy)[0]
    assert again.token_ids == rest[1].token_ids
    assert again.outputs[0].logprobs == rest[1].outputs[0].logprobs  # floats compared exactly


@pytest.mark.skipif(TEST_DEVICE == "cuda" and torch.cuda.device_count() < 2, reason="2 ranks need 2 GPUs")
def test_two_tensor_parallel_ranks_on_the_kernels_generate_what_one_rank_does(tiny_checkpoint):
    """Each rank's cache holds its own kv head, read by the same kernels (gloo on CPU)."""
    options = dict(dtype="float32", num_kv_blocks=32, max_num_batched_tokens=32, kv_populate_seconds=0,
                   device=TEST_DEVICE)
    batch = prompts(seed=2)[1:]
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    expected = [output.token_ids for output in LLM(str(tiny_checkpoint), **options).generate(batch, greedy)]
    parallel = LLM(str(tiny_checkpoint), tensor_parallel_size=2, triton_kernels=True, **options)
    try:
        assert [output.token_ids for output in parallel.generate(batch, greedy)] == expected
        assert parallel.engine.runner.kv_caches[0].shape[2] == 1  # one of the two kv heads
    finally:
        parallel.engine.shutdown()


def test_the_kernels_on_a_cpu_need_the_interpreter(tiny_checkpoint, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        LLM(str(tiny_checkpoint), device="cpu", triton_kernels=True, num_kv_blocks=8)
