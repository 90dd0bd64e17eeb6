"""Tensor parallel on CPU with 2 ranks (gloo): the same greedy tokens as one rank in fp32, with
prefix-cache hits, chunked prefill and preemption in the same run; prompt logprobs from the
gathered vocabulary; native decode off; and a rank that dies fails the engine at once, naming it.

One TP=2 engine per architecture (process start and loading cost seconds), built after the one
before it is stopped."""

from __future__ import annotations

import gc
import os
import signal
import time
from collections.abc import Iterator

import pytest
import torch

from bulkinfer.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from bulkinfer.engine.models.native_decode import NativeDecode
from bulkinfer.engine.parallel.group import TensorParallelError
from tests.engine.hf_reference import TEST_DEVICE, assert_greedy_within_noise
from tests.engine.test_llm_correctness import PROMPTS

ARCHS = ["llama", "qwen2", "qwen3", "mistral", "gemma3", "phi3", "qwen3_moe", "mixtral", "qwen2_moe"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
# Few blocks, a small token budget and no growth reserve: the run preempts and chunks its prefills,
# and the shared prefixes of PROMPTS hit the prefix cache.
# On CUDA (benchmarks/gpu_check.sh with 2+ GPUs: BULKINFER_TEST_DEVICE=cuda) rank r runs on GPU r.
OPTIONS = dict(dtype="float32", num_kv_blocks=15, max_num_batched_tokens=64, kv_growth_reserve_tokens=0,
               kv_populate_seconds=0, device=TEST_DEVICE)


def token_ids(outputs) -> list[list[int]]:  # noqa: ANN001
    for output in outputs:
        assert output.error is None, output.error
    return [output.outputs[0].token_ids for output in outputs]


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, checkpoint_factory) -> Iterator[tuple[LLM, LLM]]:  # noqa: ANN001
    """(one rank, two ranks) engines of the same checkpoint and options."""
    model = str(checkpoint_factory(arch=request.param))
    single = LLM(model, **OPTIONS)
    parallel = LLM(model, tensor_parallel_size=2, **OPTIONS)
    yield single, parallel
    parallel.engine.shutdown()


def test_two_ranks_generate_the_tokens_one_rank_does(pair: tuple[LLM, LLM]) -> None:
    single, parallel = pair
    expected = token_ids(single.generate(PROMPTS, GREEDY))
    assert token_ids(parallel.generate(PROMPTS, GREEDY)) == expected
    metrics = parallel.engine.get_metrics()
    assert metrics["num_preemptions"] > 0
    assert metrics["prefix_cache_hits"] > 0
    # Every rank holds one of the two KV heads: the cache per rank is half of one rank's.
    assert parallel.engine.runner.kv_caches[0].shape[2] == single.engine.runner.kv_caches[0].shape[2] // 2


def test_prompt_logprobs_cover_the_whole_vocabulary_as_with_one_rank(pair: tuple[LLM, LLM]) -> None:
    single, parallel = pair
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3, logprobs=2)
    prompts = PROMPTS[:3]
    for one, two in zip(single.generate(prompts, params), parallel.generate(prompts, params), strict=True):
        assert two.outputs[0].token_ids == one.outputs[0].token_ids
        assert len(two.prompt_logprobs) == len(one.prompt_logprobs)
        tops = set()
        for a, b in zip(one.prompt_logprobs[1:], two.prompt_logprobs[1:], strict=True):
            # (Not the rank of a token deep in the distribution: the ranks' partial sums round in
            # the last bits, which reorders near-ties there.)
            assert b.chosen.token_id == a.chosen.token_id
            assert b.chosen.logprob == pytest.approx(a.chosen.logprob, abs=1e-4)
            assert [t.token_id for t in b.top] == [t.token_id for t in a.top]
            assert [t.logprob for t in b.top] == pytest.approx([t.logprob for t in a.top], abs=1e-4)
            tops.update(t.token_id for t in b.top)
        assert max(tops) >= 1024  # top tokens from the second rank's half of the vocabulary too


def test_native_decode_is_off_for_a_tensor_parallel_rank(pair: tuple[LLM, LLM]) -> None:
    """The all-layers native decode call cannot all-reduce between layers."""
    single, parallel = pair
    assert parallel.engine.model.native_decode is None
    model = single.engine.model
    # Where this CPU runs it for one rank, the same model marked as a rank gets none.
    if model.native_decode is not None:
        kernels = model.native_decode.kernels
        model.tensor_parallel_size = 2
        try:
            assert NativeDecode.for_model(model, kernels) is None
        finally:
            del model.tensor_parallel_size


def test_two_ranks_run_steps_ahead_with_the_tokens_one_rank_gives(tiny_checkpoint, monkeypatch) -> None:  # noqa: ANN001
    """Async scheduling with 2 ranks: rank 0 fills a step's placeholder inputs from the step before
    on the device and sends the other ranks the same tokens from the host, so every rank embeds
    the same ids; with preemption, chunked prefill, seeded rows and n-gram drafts verified ahead
    (rejected: steps voided), the tokens one synchronous rank gives."""
    from bulkinfer.engine.scheduler import Scheduler

    model = str(tiny_checkpoint)
    params = [SamplingParams(temperature=0.0, max_tokens=10) if i % 2 else
              SamplingParams(temperature=0.9, seed=i, max_tokens=10) for i in range(len(PROMPTS))]
    ngram = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
             "disable_by_batch_size": 64}
    single = LLM(model, speculative_config=ngram, **OPTIONS)
    expected = token_ids(single.generate(PROMPTS, params))
    committed, commit = [], Scheduler.commit_in_flight

    def counted(scheduler, output):  # noqa: ANN001, ANN202
        committed.append(sum(bool(chunk.spec_token_ids) for chunk in output.chunks))
        return commit(scheduler, output)

    monkeypatch.setattr(Scheduler, "commit_in_flight", counted)
    parallel = LLM(model, tensor_parallel_size=2, async_scheduling=True, speculative_config=ngram, **OPTIONS)
    try:
        assert token_ids(parallel.generate(PROMPTS, params)) == expected
        assert parallel.engine.get_metrics()["num_preemptions"] > 0
    finally:
        parallel.engine.shutdown()
    assert len(committed) > 10 and sum(committed) > 0  # steps ran ahead, drafts among them


def test_fixed_shape_steps_are_allowed_with_tensor_parallel_and_a_rank_count_below_one_is_not(
        tiny_checkpoint) -> None:  # noqa: ANN001
    # Two ranks on the fixed-shape path: tests/engine/test_mixed_graphs.py.
    EngineConfig(model=str(tiny_checkpoint), tensor_parallel_size=2, decode_graphs=True).validate()
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        EngineConfig(model=str(tiny_checkpoint), tensor_parallel_size=0).validate()


def test_a_rank_killed_mid_generation_fails_the_engine_at_once_naming_it(tiny_checkpoint) -> None:  # noqa: ANN001
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint), tensor_parallel_size=2, **OPTIONS))
    for i, prompt in enumerate(PROMPTS[:4]):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=64))
    for _ in range(3):
        engine.step()
    (pid,) = engine.parallel.rank_pids
    os.kill(pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(TensorParallelError, match="rank 1") as failure:
        for _ in range(100):
            engine.step()
    assert time.monotonic() - started < 10
    assert "exited with code -9" in str(failure.value) or "rank 1 is gone" in str(failure.value)
    # The engine stays failed (never hangs on the dead rank), and its ranks are gone.
    with pytest.raises(TensorParallelError):
        engine.step()
    assert all(process.poll() is not None for process in engine.parallel._processes)
    del engine, failure
    gc.collect()  # dropping the broken group must not take this process down


def test_a_rank_that_raises_fails_the_engine_with_its_error(tiny_checkpoint) -> None:  # noqa: ANN001
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint), tensor_parallel_size=2, **OPTIONS))
    engine.add_request("a", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=8))
    engine.step()
    engine.parallel.send("no-such-message")  # the rank raises on it, reports and exits
    message = "rank 1 raised: ValueError: unknown tensor-parallel message"
    with pytest.raises(TensorParallelError, match=message):
        for _ in range(20):
            engine.step()


def test_two_ranks_in_bf16_agree_with_transformers_within_noise(tiny_checkpoint) -> None:  # noqa: ANN001
    """bf16: each rank's partial sums round before the all-reduce, so tokens may flip where the
    logits are near-ties (as between our engine and transformers): 95% must be transformers' argmax
    and every other one a bf16 near-tie (hf_reference.assert_greedy_within_noise; the engine-side gap
    is read from one rank's model of the same weights: a rank's model cannot run alone)."""
    model = str(tiny_checkpoint)
    options = {**OPTIONS, "dtype": "bfloat16", "num_kv_blocks": 256}
    parallel = LLM(model, tensor_parallel_size=2, **options)
    try:
        outputs = token_ids(parallel.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=32)))
    finally:
        parallel.engine.shutdown()
    single = LLM(model, **options)
    assert_greedy_within_noise(list(zip(PROMPTS, outputs, strict=True)), model, single.engine.model,
                               torch.bfloat16)


def test_four_ranks_replicate_the_two_kv_heads_and_generate_the_tokens_one_rank_does(
        tiny_checkpoint) -> None:  # noqa: ANN001
    """tiny has 4 query heads and 2 KV heads: over 4 ranks each holds one query head and a copy of
    the KV head its query head reads (ranks 0-1 KV head 0, ranks 2-3 KV head 1)."""
    model = str(tiny_checkpoint)
    prompts = PROMPTS[:6]
    expected = token_ids(LLM(model, **OPTIONS).generate(prompts, GREEDY))
    parallel = LLM(model, tensor_parallel_size=4, **OPTIONS)
    try:
        assert token_ids(parallel.generate(prompts, GREEDY)) == expected
        assert parallel.engine.runner.kv_caches[0].shape[2] == 1
    finally:
        parallel.engine.shutdown()
