"""The fixed-shape decode path (engine/decode_graphs.py): what a GPU replays as CUDA graphs.

On a GPU it is the default, so every engine correctness test already runs through it there
(benchmarks/gpu_check.sh); here it runs on the CPU without capture (`decode_graphs=True`), where
the same padding, buffers and device-side masking must give what the eager path gives: transformers'
greedy tokens in fp32, within bf16 noise in bf16, on every architecture, while the batch shrinks
through the padded sizes and the contexts grow through the padded widths.
"""

from __future__ import annotations

import random

import pytest
import torch

from bulkinfer.engine import LLM, EngineConfig, SamplingParams
from bulkinfer.engine.attention import AttentionMetadata
from bulkinfer.engine.decode_graphs import (
    BATCH_BUCKETS,
    GRAPH_GATHER_BYTES,
    batch_bucket,
    width_bucket,
)
from tests.engine.hf_reference import TEST_DEVICE, assert_greedy_within_noise, assert_same_greedy, hf_greedy
from tests.engine.test_llm_correctness import ARCHS, DTYPES, PROMPTS, greedy
from tests.engine.test_model_vs_transformers import SMALL, run_and_compare, save_random_model


@pytest.fixture(scope="module", params=ARCHS)
def arch_dir(request, checkpoint_factory) -> str:
    return str(checkpoint_factory(arch=request.param))


def record_fixed_shape_steps(llm: LLM, monkeypatch) -> list[tuple[int, int]]:
    """The (padded rows, padded width) of every decode step that ran through the fixed-shape path."""
    graphs = llm.engine.runner._decode_graphs()
    assert graphs is not None
    shapes: list[tuple[int, int]] = []
    original = graphs._forward if not graphs.capture else None

    def recorded(rows: int, width: int) -> torch.Tensor:
        shapes.append((rows, width))
        return original(rows, width)

    if original is not None:
        monkeypatch.setattr(graphs, "_forward", recorded)
    return shapes


def assert_matches_transformers(model_dir: str, llm: LLM, prompts: list[list[int]], outputs) -> None:
    """Each output against transformers on its own prompt, for as many tokens as it has: fp32 the
    same greedy tokens (or a proven tie), bf16 within noise."""
    model = llm.engine.model
    for output in outputs:
        assert output.error is None, output.error
    if llm.engine.dtype_choice.dtype == "float32":
        for prompt, output in zip(prompts, outputs, strict=True):
            reference = hf_greedy(model_dir, prompt, len(output.token_ids))
            assert_same_greedy(output.token_ids, reference, prompt, model_dir, model)
    else:
        pairs = [(prompt, output.token_ids) for prompt, output in zip(prompts, outputs, strict=True)]
        assert_greedy_within_noise(pairs, model_dir, model, torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_steps_through_fixed_shapes_match_transformers(arch_dir, dtype, monkeypatch):
    """18 prompts of 1-102 tokens (10 under shared instructions, which the fixed-shape path does
    not group) with max_tokens from 2 to the dtype's length: the batch shrinks from 18 rows (padded
    to 24) down to 1 as requests finish."""
    llm = LLM(model=arch_dir, device=TEST_DEVICE, num_kv_blocks=256, dtype=dtype, decode_graphs=True)
    shapes = record_fixed_shape_steps(llm, monkeypatch)
    longest = greedy(dtype).max_tokens
    params = [SamplingParams(temperature=0.0, max_tokens=2 + i * (longest - 2) // (len(PROMPTS) - 1))
              for i in range(len(PROMPTS))]
    outputs = llm.generate(PROMPTS, params)
    assert all(len(o.token_ids) <= p.max_tokens for o, p in zip(outputs, params, strict=True))
    graphs = llm.engine.runner.decode_graphs
    if graphs.capture:  # a GPU: the steps were captured and replayed
        assert graphs.graphs and not graphs.broken and not graphs.failed
    else:
        padded_rows = {rows for rows, _ in shapes}
        assert {24, 1} <= padded_rows <= set(BATCH_BUCKETS)
        assert {width for _, width in shapes} == {8}  # up to 110 tokens: 7 blocks, padded to 8
    assert_matches_transformers(arch_dir, llm, PROMPTS, outputs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_long_contexts_cross_the_padded_widths(checkpoint_factory, dtype, monkeypatch):
    """Contexts from 40 to 300 tokens: the block tables' width is padded to 4, 8, 16 and 32 blocks,
    every row masked at its own length."""
    model_dir = str(checkpoint_factory(arch="llama"))
    rng = random.Random(3)
    prompts = [[rng.randrange(5, 2048) for _ in range(n)] for n in (40, 90, 150, 280)]
    llm = LLM(model=model_dir, device=TEST_DEVICE, num_kv_blocks=128, dtype=dtype, decode_graphs=True)
    shapes = record_fixed_shape_steps(llm, monkeypatch)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    if not llm.engine.runner.decode_graphs.capture:
        assert {width for _, width in shapes} == {32}  # the longest row's 19 blocks, padded
        assert {rows for rows, _ in shapes} == {4}
    assert_matches_transformers(model_dir, llm, prompts, outputs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sliding_window_decodes_through_fixed_shapes(dtype, tmp_path):
    """A Mistral window of 8: the device-side mask hides keys past the window as the eager plan does."""
    from transformers import MistralConfig

    config = MistralConfig(**SMALL, sliding_window=8, architectures=["MistralForCausalLM"])
    model_dir = save_random_model(config, tmp_path / "mistral-window")
    runner = run_and_compare(
        model_dir, [{0: 30, 1: 12, 2: 5}, {0: 1, 1: 18, 2: 1}], lengths=[30, 30, 5], num_decode_steps=12,
        dtype=dtype, decode_graphs=True,
    )
    assert runner.decode_graphs is not None


def test_preempted_and_speculated_rows_decode_through_fixed_shapes(arch_dir):
    """A pool too small for every request (preemptions, recomputation) and n-gram speculation (each
    verified draft a decode row of its own): fp32 outputs equal the eager path's token for token."""
    prompts = PROMPTS[:10]
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2,
             "disable_by_batch_size": 1024}
    params = SamplingParams(temperature=0.0, max_tokens=12)
    runs = {}
    for fixed in (True, False):
        llm = LLM(model=arch_dir, device=TEST_DEVICE, num_kv_blocks=12, dtype="float32",
                  kv_growth_reserve_tokens=0, decode_graphs=fixed)
        runs[("small pool", fixed)] = (llm.generate(prompts, params), llm.get_metrics()["num_preemptions"])
        llm = LLM(model=arch_dir, device=TEST_DEVICE, num_kv_blocks=128, dtype="float32",
                  speculative_config=ngram, decode_graphs=fixed)
        runs[("ngram", fixed)] = (llm.generate(prompts, params), 0)
    assert runs[("small pool", True)][1] > 0
    for scenario in ("small pool", "ngram"):
        got, want = runs[(scenario, True)][0], runs[(scenario, False)][0]
        assert [o.token_ids for o in got] == [o.token_ids for o in want], scenario


def test_padded_sizes():
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 13, 100, 1024)] == [1, 2, 4, 8, 16, 128, 1024]
    assert batch_bucket(1025) is None
    assert batch_bucket(3, (1, 2, 3)) == 3
    # Widths: powers of two from 4 blocks, never past a sequence's most.
    assert [width_bucket(n, 128) for n in (1, 4, 5, 9, 100, 128)] == [4, 4, 8, 16, 128, 128]
    assert width_bucket(70, 100) == 100


def test_steps_it_does_not_take_run_eagerly(tiny_checkpoint):
    """A step with prefill chunks, more rows than the largest padded size, or a gather past the
    budget: run() declines (None) and the runner takes the eager path."""
    llm = LLM(model=str(tiny_checkpoint), num_kv_blocks=64, dtype="float32", decode_graphs=True,
              max_num_seqs=8)
    graphs = llm.engine.runner._decode_graphs()
    assert graphs is not None and graphs.buckets[-1] == 8
    model = llm.engine.model
    metadata = AttentionMetadata(block_size=16, slot_mapping=torch.zeros(3, dtype=torch.long), num_decodes=1,
                                 decode_seq_lens=torch.tensor([5]), decode_block_tables=torch.ones(1, 1,
                                                                                                   dtype=torch.long),
                                 prefill_query_starts=[1], prefill_query_lens=[2], prefill_seq_lens=[2],
                                 prefill_block_tables=[torch.tensor([2])])
    tokens = torch.zeros(3, dtype=torch.long)
    assert graphs.run(tokens, tokens, metadata, torch.tensor([0, 2])) is None
    assert graphs.shape_for(9, 1) is None  # past max_num_seqs' padded size
    per_token = 2 * model.config.num_kv_heads * model.config.head_dim * 4
    too_wide = GRAPH_GATHER_BYTES // (8 * 16 * per_token) + 1
    graphs.max_blocks = 1 << too_wide.bit_length()
    assert graphs.shape_for(8, too_wide) is None
    assert graphs.shape_for(8, 4) == (8, 4)


def test_decode_graphs_setting_is_checked():
    with pytest.raises(ValueError, match="decode_graphs"):
        EngineConfig(model="m", decode_graphs="yes").validate()


@pytest.mark.parametrize("error", [torch.cuda.OutOfMemoryError, RuntimeError], ids=["out-of-memory", "bug"])
def test_a_capture_that_fails_leaves_steps_eager_and_outputs_unchanged(tiny_checkpoint, error, monkeypatch):
    """A GPU that cannot record a shape (no memory left) runs that shape eagerly from then on, trying
    it once; any other capture error (an op a graph cannot hold) turns the graphs off for good. The
    engine keeps serving either way, with the tokens it would have given."""
    prompts = PROMPTS[:6]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = LLM(model=str(tiny_checkpoint), num_kv_blocks=64, dtype="float32").generate(prompts, params)
    llm = LLM(model=str(tiny_checkpoint), num_kv_blocks=64, dtype="float32", decode_graphs=True)
    graphs = llm.engine.runner._decode_graphs()
    graphs.capture = True  # as on a GPU, whose recording fails here
    attempts: list[tuple[int, int]] = []

    def failing_record(rows: int, width: int):
        attempts.append((rows, width))
        raise error("CUDA out of memory" if error is torch.cuda.OutOfMemoryError
                    else "operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs, "_record", failing_record)
    got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert not graphs.graphs and attempts
    if error is torch.cuda.OutOfMemoryError:
        assert not graphs.broken and graphs.failed == set(attempts) and len(attempts) == len(set(attempts))
    else:
        assert graphs.broken and len(attempts) == 1
