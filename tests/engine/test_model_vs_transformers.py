"""Model + runner + paged attention logits against transformers' logits on the same weights.

One runner step mixes every kind of chunk (full prefill, partial prefill, prefill continuing
after a cached context, decodes), so batch building, the slot mapping, the decode and prefill
attention paths and the LM-head row selection are all checked at once.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen3Config

from bulkinfer.engine.attention import TorchPagedAttention, attention_with_lse, decode_chunk_rows
from bulkinfer.engine.config import EngineConfig
from bulkinfer.engine.model_runner import ModelRunner
from bulkinfer.engine.models import load_model
from bulkinfer.engine.models.llama_config import rope_inverse_frequencies
from bulkinfer.engine.request import Request
from bulkinfer.engine.sampling_params import SamplingParams
from bulkinfer.engine.scheduler import ScheduledChunk, SchedulerOutput
from bulkinfer.engine.step_batch import BatchRow, padded_block_tables, prepare_rows
from tests.engine.hf_reference import (
    TEST_DEVICE,
    assert_same_greedy,
    hf_greedy,
    is_mixture_of_experts,
    noise_bound,
)

ARCHS = ["llama", "qwen2", "qwen3", "mistral", "gemma3", "phi3", "qwen3_moe", "mixtral", "qwen2_moe"]
DTYPES = ["float32", "bfloat16", "float16"]


def make_request(request_id: str, length: int, vocab_size: int, seed: int) -> Request:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(5, vocab_size, (length,), generator=gen).tolist()
    return Request(request_id, tokens, SamplingParams(temperature=0.0))


def run_and_compare(model_dir, steps_plan, lengths=None, num_decode_steps=3, requests=None, backend=None,
                    dtype="float32", decode_graphs=None):
    """Drive the runner through a fixed plan and compare every sampled row with transformers.

    ``steps_plan``: per step, {request index: tokens to compute}; then ``num_decode_steps`` steps
    where every request decodes one token (``decode_graphs``: the engine setting, through the
    fixed-shape path when true). Returns the runner (for further inspection).
    fp32: logits within 1e-4 and the same argmax. bf16/fp16: transformers in the same dtype; logits
    within the dtype's noise (``noise_bound``), and a different argmax only between near-tied tokens.
    """
    config = EngineConfig(model=str(model_dir), num_kv_blocks=64, max_model_len=512, dtype=dtype,
                          device=TEST_DEVICE, decode_graphs=decode_graphs)
    torch_dtype = getattr(torch, dtype)
    model = load_model(model_dir, backend or TorchPagedAttention(), dtype=torch_dtype,
                       device=TEST_DEVICE)
    runner = ModelRunner(config, model)
    runner.initialize_kv_cache()
    vocab = model.config.vocab_size
    if requests is None:
        requests = [make_request(str(i), n, vocab, seed=i) for i, n in enumerate(lengths)]
        # Non-contiguous, interleaved block tables, as a real pool hands them out.
        for i, request in enumerate(requests):
            request.block_ids = [1 + i + len(requests) * j for j in range(12)]
    plan = list(steps_plan) + [dict.fromkeys(range(len(requests)), 1)] * num_decode_steps

    sampled_rows: list[tuple[Request, int, torch.Tensor]] = []  # request, position, logits
    for step in plan:
        chunks = [ScheduledChunk.of(requests[i], n) for i, n in step.items()]
        logits = runner.execute(SchedulerOutput(chunks, sum(step.values()))).cpu()
        assert logits.dtype == torch.float32  # the LM head's fp32 sums in every dtype, unrounded
        logits = logits.float()
        samplers = [c.request for c in chunks if c.samples]
        assert logits.shape == (len(samplers), vocab)
        for chunk in chunks:
            chunk.request.num_computed_tokens += chunk.num_new_tokens
        for request, row in zip(samplers, logits, strict=True):
            sampled_rows.append((request, request.num_tokens - 1, row))
            request.all_token_ids.append(int(row.argmax()))
            request.output_token_ids.append(int(row.argmax()))

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).eval()
    with torch.inference_mode():
        hf_logits = {
            r.request_id: hf(torch.tensor([r.all_token_ids[:-1]])).logits[0].float() for r in requests
        }
    if torch_dtype != torch.float32 and is_mixture_of_experts(model):
        assert_moe_logits_within_noise(model_dir, requests, sampled_rows, hf_logits, torch_dtype)
        return runner
    for request, position, ours in sampled_rows:
        theirs = hf_logits[request.request_id][position]
        if torch_dtype == torch.float32:
            torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
            assert int(ours.argmax()) == int(theirs.argmax()), (request.request_id, position)
            continue
        bound = noise_bound(theirs, torch_dtype)
        worst = float((ours - theirs).abs().max())
        assert worst <= bound, f"{request.request_id}@{position}: logits differ by {worst:.3g} > {bound:.3g}"
        chosen, reference = int(ours.argmax()), int(theirs.argmax())
        assert float(theirs[reference] - theirs[chosen]) <= bound, (request.request_id, position)
    return runner


# A mixture-of-experts model's bf16/fp16 logits, measured against fp32: the engine's median error
# over the sampled rows within this factor of transformers' own (see assert_moe_logits_within_noise).
MOE_ERROR_FACTOR = 1.5


def assert_moe_logits_within_noise(model_dir, requests, sampled_rows, hf_logits, dtype) -> None:
    """The engine's reduced-precision logits are as close to the fp32 model's as transformers' in the
    same dtype are. Per row, a routing near-tie decided differently in two correct implementations
    moves the logits by whole units (transformers' own bf16 differs from its fp32 by up to ~7 on the
    tiny checkpoints, where its median row differs by 0.2-1.4), so rows are not held to the dense
    families' per-row bound; the median row is."""
    hf32 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        exact = {r.request_id: hf32(torch.tensor([r.all_token_ids[:-1]])).logits[0] for r in requests}
    ours_err, theirs_err, bounds = [], [], []
    for request, position, ours in sampled_rows:
        reference = exact[request.request_id][position]
        theirs = hf_logits[request.request_id][position]
        ours_err.append(float((ours - reference).abs().max()))
        theirs_err.append(float((theirs - reference).abs().max()))
        bounds.append(noise_bound(theirs, dtype))
    ours_median, theirs_median = torch.tensor(ours_err).median(), torch.tensor(theirs_err).median()
    allowed = MOE_ERROR_FACTOR * theirs_median + torch.tensor(bounds).median()
    assert ours_median <= allowed, (
        f"median error vs fp32: engine {ours_median:.3g}, transformers {theirs_median:.3g} "
        f"(allowed {allowed:.3g})")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_step_logits_match_transformers(arch, dtype, checkpoint_factory):
    # Request 0: 20-token prefill; 1: 30 tokens in chunks of 10 and 20; 2: a 1-token prompt
    # (decode path at position 0); 3: 37 tokens in chunks of 16, 16 and 5.
    plan = [
        {0: 20, 1: 10, 2: 1, 3: 16},
        {0: 1, 1: 20, 2: 1, 3: 16},
        {0: 1, 1: 1, 2: 1, 3: 5},
    ]
    run_and_compare(checkpoint_factory(arch=arch), plan, lengths=[20, 30, 1, 37], dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_one_token_prompt_chunk_that_does_not_sample_runs_among_the_decodes(dtype, checkpoint_factory):
    """The last layer finishes only the sampled rows: here the leading single-token rows are a decode
    (sampled) then a 1-token partial prefill (not sampled), so the kept rows' single-token count
    (1) differs from the step's (2), and the rows come back in the chunks' order."""
    # Request 1: 30 tokens in chunks of 9, 1 and 20; request 2 (12 tokens) joins in step 2.
    plan = [{0: 20, 1: 9}, {0: 1, 1: 1, 2: 12}, {0: 1, 1: 20, 2: 1}]
    run_and_compare(checkpoint_factory(arch="qwen2"), plan, lengths=[20, 30, 12], dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_rows_sharing_prefix_blocks_match_transformers(dtype, checkpoint_factory):
    """Cascade decode: rows whose tables start with the same blocks attend that prefix as a group."""
    model_dir = checkpoint_factory(arch="qwen3")
    shared = make_request("shared", 40, 2048, seed=10).prompt_token_ids
    tails = [
        make_request(f"tail{i}", n, 2048, seed=20 + i).prompt_token_ids for i, n in enumerate((5, 12, 30))
    ]
    requests = [
        Request(str(i), shared + tail, SamplingParams(temperature=0.0)) for i, tail in enumerate(tails)
    ]
    # Row 0 owns blocks 1-2 (the two full blocks of the shared 40 tokens); rows 1 and 2 found them
    # in the prefix cache, so their tables start with the same blocks and 32 tokens are computed.
    requests[0].block_ids = [1, 2, 3, 4, 5, 6]
    requests[1].block_ids = [1, 2, 7, 8, 9, 10]
    requests[2].block_ids = [1, 2, 11, 12, 13, 14]
    backend = TorchPagedAttention(min_shared_tokens=0)
    plan = [{0: 45}, {0: 1, 1: 20, 2: 38}]
    for request in requests[1:]:
        request.num_computed_tokens = 32
    runner = run_and_compare(model_dir, plan, num_decode_steps=6, requests=requests, backend=backend,
                             dtype=dtype)

    # The last step's decode plan really grouped the three rows over the two shared blocks.
    last = [ScheduledChunk(r, r.num_computed_tokens - 1, 1, True, tuple(r.block_ids)) for r in requests]
    metadata = runner.prepare_batch(SchedulerOutput(last, 3)).metadata
    [group] = backend.decode_plan(metadata, None, 2).shared_prefixes
    assert group.rows.tolist() == [0, 1, 2] and group.block_ids.tolist() == [1, 2]


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_rows_attended_one_per_chunk_match_transformers(dtype, checkpoint_factory):
    """The PyTorch decode path in chunks of one row (a 1-byte chunk) gives every row's own result."""
    plan = [{0: 20, 1: 30, 2: 7, 3: 37}]
    run_and_compare(checkpoint_factory(arch="llama"), plan, lengths=[20, 30, 7, 37], num_decode_steps=4,
                    backend=TorchPagedAttention(decode_chunk_bytes=1), dtype=dtype)


def test_decode_chunks_stay_in_a_cpu_cache_and_take_far_more_rows_on_a_gpu():
    row_bytes = 2 * 3 * 480 * 64 * 2  # K+V of one SmolLM2 row over 480 keys in bf16
    assert decode_chunk_rows(torch.device("cpu"), row_bytes, 512, 16 << 20) == 45
    assert decode_chunk_rows(torch.device("cpu"), row_bytes, 512, 1) == 1
    assert decode_chunk_rows(torch.device("cuda"), row_bytes, 512, 16 << 20) == 512  # one call
    # A long context on a GPU is still split: the gather comes out of what the KV cache leaves free.
    long_row = 2 * 8 * 8192 * 128 * 2  # 8 kv heads of 128 over 8,192 keys: 32 MiB a row
    assert decode_chunk_rows(torch.device("cuda"), long_row, 512, 16 << 20) == 8


def test_attention_with_lse_kernel_and_fallback_agree():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 2, n, 16, generator=gen) for n in (2, 40, 40))
    bias = torch.zeros(3, 1, 1, 40)
    bias[0, ..., 30:] = float("-inf")
    kernel_out, kernel_lse = attention_with_lse(q, k, v, bias, use_cpu_kernel=True)
    plain_out, plain_lse = attention_with_lse(q, k, v, bias, use_cpu_kernel=False)
    torch.testing.assert_close(kernel_out, plain_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(kernel_lse, torch.logsumexp((q @ k.transpose(-1, -2)) / 4 + bias, -1))
    torch.testing.assert_close(plain_lse, kernel_lse)


def save_random_model(model_cls_config, path, seed: int = 0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(model_cls_config).eval()
    with torch.no_grad():  # larger weights than the default init, so logits are far from ties
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0, 0.08)
    model.save_pretrained(path)
    return path


SMALL = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def test_llama3_rope_scaling_matches_transformers(tmp_path):
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    config = LlamaConfig(**SMALL, rope_parameters=rope, architectures=["LlamaForCausalLM"])
    model_dir = save_random_model(config, tmp_path / "llama3")
    ours = rope_inverse_frequencies(load_model(model_dir, TorchPagedAttention()).config)
    hf = AutoModelForCausalLM.from_pretrained(model_dir).model.rotary_emb.inv_freq
    assert torch.equal(ours, hf)
    run_and_compare(model_dir, [{0: 100, 1: 40}, {0: 1, 1: 60}], lengths=[100, 100])


@pytest.mark.parametrize("dtype", DTYPES)
def test_sliding_window_matches_transformers(dtype, tmp_path):
    config = MistralConfig(**SMALL, sliding_window=8, architectures=["MistralForCausalLM"])
    model_dir = save_random_model(config, tmp_path / "mistral-window")
    run_and_compare(
        model_dir, [{0: 30, 1: 12, 2: 5}, {0: 1, 1: 18, 2: 1}], lengths=[30, 30, 5], num_decode_steps=12,
        dtype=dtype,
    )


def test_qwen3_explicit_head_dim_matches_transformers(tmp_path):
    # head_dim 32 != hidden 64 / 4 heads: q/k/v/o shapes and the per-head q/k norms follow head_dim.
    config = Qwen3Config(**SMALL, head_dim=32, architectures=["Qwen3ForCausalLM"])
    model_dir = save_random_model(config, tmp_path / "qwen3-hd32")
    run_and_compare(model_dir, [{0: 25, 1: 9}, {0: 1, 1: 16}], lengths=[25, 25])


def test_tie_check_rejects_a_real_difference(tiny_checkpoint):
    model = load_model(tiny_checkpoint, TorchPagedAttention())
    prompt = [5, 6, 7, 8, 9, 10]
    reference = hf_greedy(tiny_checkpoint, prompt, 4)
    wrong = [reference[0], (reference[1] + 1) % 2048, *reference[2:]]
    with pytest.raises(AssertionError, match="not an fp32 tie"):
        assert_same_greedy(wrong, reference, prompt, tiny_checkpoint, model)
    with pytest.raises(AssertionError, match="lengths differ"):
        assert_same_greedy(reference[:2], reference, prompt, tiny_checkpoint, model)


def test_block_tables_are_padded_with_the_null_block_and_decodes_come_first():
    padded = padded_block_tables([[4, 5, 6], [7], [8, 9]], 4)
    assert padded.tolist() == [[4, 5, 6, 0], [7, 0, 0, 0], [8, 9, 0, 0]] and padded.dtype == torch.long
    # A prefill chunk of 3 tokens between two decodes: the decodes lead, each with its own blocks
    # up to its new token; the sampled rows come back in the rows' own order.
    rows = [BatchRow([11], 20, (3, 4, 9), 1), BatchRow([12, 13, 14], 0, (5,), 1),
            BatchRow([15], 16, (6, 7), 1)]
    step = prepare_rows(rows, 16, torch.device("cpu"))
    assert step.metadata.num_decodes == 2
    assert step.metadata.decode_block_tables.tolist() == [[3, 4], [6, 7]]
    assert step.input_ids.tolist() == [11, 15, 12, 13, 14] and step.positions.tolist() == [20, 16, 0, 1, 2]
    assert step.metadata.slot_mapping.tolist() == [4 * 16 + 4, 7 * 16 + 0, 80, 81, 82]
    assert step.sample_rows.tolist() == [0, 4, 1]
    # The last layer finishes rows 0, 1 and 4 (two of them single-token rows), handed back as 0, 4, 1.
    assert step.final_rows is not None and step.final_rows.rows.tolist() == [0, 1, 4]
    assert step.final_rows.num_single == 2 and step.final_rows.order.tolist() == [0, 2, 1]
    # Every row sampled (a pure decode step): nothing to leave out.
    assert prepare_rows(rows[::2], 16, torch.device("cpu")).final_rows is None
