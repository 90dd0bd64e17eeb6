"""Triton's layer ops (engine/gpu_kernels/layer_ops.py) against the PyTorch path the model takes
without kernels: each op alone, then a tiny model's logits with them switched on.

On CPU the kernels run under Triton's interpreter (set before the kernel module is imported, which
decides it at decoration); with BULKINFER_TEST_DEVICE=cuda the same tests run compiled on the GPU."""

from __future__ import annotations

import os

DEVICE = os.environ.get("BULKINFER_TEST_DEVICE", "cpu")
if DEVICE != "cuda":
    os.environ.setdefault("TRITON_INTERPRET", "1")

from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from bulkinfer.engine.gpu_kernels import triton_available  # noqa: E402
from bulkinfer.engine.gpu_kernels.layer_ops import TritonLayerOps  # noqa: E402
from bulkinfer.engine.models.layers import MLP, Linear, RMSNorm, apply_rope  # noqa: E402
from bulkinfer.engine.models.phi3 import Phi3Attention  # noqa: E402
from bulkinfer.engine.models.sparse_moe import SparseMoeBlock  # noqa: E402

OPS = TritonLayerOps(allow_cpu=True)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32: within an fp32 intermediate's last places (exp, a tree sum); 16-bit: within one rounding."""
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:
        torch.testing.assert_close(got, want)


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(device=DEVICE, dtype=dtype)


def test_layer_ops_apply_to_cuda_tensors_and_cpu_ones_only_when_allowed() -> None:
    assert triton_available()
    cpu = torch.zeros(2, dtype=torch.bfloat16)
    assert OPS.layer_ops_apply(cpu) and not TritonLayerOps().layer_ops_apply(cpu)
    assert not OPS.layer_ops_apply(torch.zeros(2, dtype=torch.float64))
    assert OPS.layer_ops_apply(torch.zeros(2, dtype=torch.float16))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_matches_the_pytorch_norm(dtype: torch.dtype, with_residual: bool) -> None:
    norm = RMSNorm(48, 1e-6).to(device=DEVICE, dtype=dtype)
    norm.weight.copy_(randn(48, dtype=dtype, seed=1))
    x, residual = randn(5, 48, dtype=dtype, seed=2), randn(5, 48, dtype=dtype, seed=3)
    if with_residual:
        want_out, want_residual = norm(x, residual.clone())
        norm.kernels = OPS
        got_out, got_residual = norm(x, residual)
        assert torch.equal(got_residual, want_residual)  # the add rounds once, as add_ does
        close(got_out, want_out)
    else:
        want = norm(x)
        norm.kernels = OPS
        close(norm(x), want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_qk_norm_reads_the_heads_of_a_fused_qkv_row_in_place(dtype: torch.dtype) -> None:
    norm = RMSNorm(16, 1e-6).to(device=DEVICE, dtype=dtype)
    norm.weight.copy_(randn(16, dtype=dtype, seed=1))
    qkv = randn(3, 8 * 16, dtype=dtype, seed=2)
    q = qkv[:, : 4 * 16].view(3, 4, 16)  # tokens 128 apart, heads 16 apart: as Attention.forward
    want = norm(q.contiguous())
    norm.kernels = OPS
    close(norm(q), want)


def rope_tables(tokens: int, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, 1, dim / 2] as RotaryEmbedding makes them."""
    positions = torch.arange(3, 3 + tokens, device=DEVICE)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=DEVICE).float() / dim))
    freqs = positions[:, None].float() * inv_freq[None, :]
    return freqs.cos().to(dtype)[:, None, :], freqs.sin().to(dtype)[:, None, :]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_rotates_q_and_k_of_a_gqa_qkv_in_place(dtype: torch.dtype) -> None:
    heads, kv_heads, dim, tokens = 4, 2, 16, 5
    qkv = randn(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype, seed=4)
    q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim)
    cos, sin = rope_tables(tokens, dim, dtype)
    want_q, want_k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    got_q, got_k = apply_rope(q, cos, sin, OPS), apply_rope(k, cos, sin, OPS)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()  # in place
    close(got_q, want_q)
    close(got_k, want_k)


@pytest.mark.parametrize("dtype", DTYPES)
def test_partial_rotary_keeps_its_pytorch_path_and_the_kernel_takes_strided_heads(dtype: torch.dtype) -> None:
    # Phi-3's partial rotary hands apply_rope heads that are not packed (rotary_dim < head_dim):
    # the model keeps PyTorch there; the kernel itself rotates such a view in place all the same.
    tokens, heads, dim, rotary = 3, 4, 16, 8
    x = randn(tokens, heads, dim, dtype=dtype, seed=5)
    cos, sin = rope_tables(tokens, rotary, dtype)
    attention = SimpleNamespace(rotary_dim=rotary, kernels=None)
    want = Phi3Attention.rotate(attention, x, cos, sin)
    attention.kernels = OPS
    close(Phi3Attention.rotate(attention, x, cos, sin), want)
    view = x.clone()[..., :rotary]
    OPS.rope_(view, cos, sin)
    close(view, want[..., :rotary])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_the_mlp_activation(dtype: torch.dtype) -> None:
    gate_up = randn(4, 2 * 40, dtype=dtype, seed=6) * 4
    want = MLP.activation(SimpleNamespace(intermediate_size=40), gate_up)
    close(OPS.silu_and_mul(gate_up), want)


def routing_block(kernels: TritonLayerOps | None, top_k: int, normalize: bool) -> SimpleNamespace:
    """What SparseMoeBlock.route reads, its gate the identity: route(logits) routes those logits."""
    return SimpleNamespace(gate=lambda x: x, kernels=kernels, top_k=top_k, norm_topk_prob=normalize,
                           routing_weights_in_fp32=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("top_k, normalize", [(2, True), (3, False), (1, True)])
def test_moe_route_matches_softmax_and_topk(dtype: torch.dtype, top_k: int, normalize: bool) -> None:
    logits = randn(6, 10, dtype=dtype, seed=7) * 3
    want_experts, want_weights = SparseMoeBlock.route(routing_block(None, top_k, normalize), logits)
    got_experts, got_weights = SparseMoeBlock.route(routing_block(OPS, top_k, normalize), logits)
    assert got_experts.dtype == torch.int64 and got_weights.dtype == torch.float32
    assert torch.equal(got_experts, want_experts)
    torch.testing.assert_close(got_weights, want_weights, rtol=1e-5, atol=1e-6)


def test_moe_route_puts_the_lower_expert_first_among_equal_probabilities() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0], [1.0, 1.0, 1.0, 1.0, 1.0]], device=DEVICE)
    experts, weights = OPS.moe_route(logits, 3, True)
    assert experts.tolist() == [[1, 3, 4], [0, 1, 2]]
    torch.testing.assert_close(weights, torch.full((2, 3), 1 / 3, device=DEVICE))


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_shared_add_matches_the_gated_tensor_expression(dtype: torch.dtype) -> None:
    gate, shared, out = randn(4, 1, dtype=dtype, seed=8), randn(4, 24, dtype=dtype, seed=9), randn(
        4, 24, dtype=dtype, seed=10)
    block = SimpleNamespace(shared_expert=lambda x: shared, shared_expert_gate=lambda x: gate, kernels=None,
                            fixed_row_blocks=False)
    want = out.clone()
    SparseMoeBlock.add_shared_expert(block, want, out)
    block.kernels = OPS
    got = out.clone()
    SparseMoeBlock.add_shared_expert(block, got, out)
    close(got, want)


class CountingOps(TritonLayerOps):
    """TritonLayerOps that counts its calls (the model really took them)."""

    def __init__(self) -> None:
        super().__init__(allow_cpu=True)
        self.calls: dict[str, int] = {}

    def __getattribute__(self, name: str):  # noqa: ANN204
        if name in ("add_rms_norm", "rope_", "silu_and_mul", "moe_route", "moe_shared_add_"):
            calls = object.__getattribute__(self, "calls")
            calls[name] = calls.get(name, 0) + 1
        return object.__getattribute__(self, name)


PROMPTS = (3, 5)


def step_logits(runner, ids: str) -> list[torch.Tensor]:
    """The logits of a prefill step of two prompts, then a decode step (requests named by ``ids``)."""
    from bulkinfer.engine.request import Request
    from bulkinfer.engine.sampling_params import SamplingParams
    from bulkinfer.engine.scheduler import ScheduledChunk, SchedulerOutput

    requests = [Request(f"{ids}{i}", list(range(5 + i, 5 + i + n)), SamplingParams(temperature=0.0))
                for i, n in enumerate(PROMPTS)]
    for i, request in enumerate(requests):
        request.block_ids = [1 + i + 2 * j for j in range(4)]  # the same blocks each time: rewritten
    logits = []
    for step in (dict(enumerate(PROMPTS)), {0: 1, 1: 1}):
        chunks = [ScheduledChunk.of(requests[i], n) for i, n in step.items()]
        logits.append(runner.execute(SchedulerOutput(chunks, sum(step.values()))).cpu())
        for chunk, row in zip(chunks, logits[-1], strict=True):
            chunk.request.num_computed_tokens += chunk.num_new_tokens
            chunk.request.all_token_ids.append(int(row.argmax()))
            chunk.request.output_token_ids.append(int(row.argmax()))
    return logits


def tiny_model(model_dir: str):  # noqa: ANN201
    from bulkinfer.engine.attention import TorchPagedAttention
    from bulkinfer.engine.config import EngineConfig
    from bulkinfer.engine.model_runner import ModelRunner
    from bulkinfer.engine.models import load_model

    # Few batched tokens: the start-up profiling step is that many rows (slow when interpreted).
    config = EngineConfig(model=model_dir, num_kv_blocks=16, max_model_len=64, dtype="float32", device=DEVICE,
                          max_num_batched_tokens=16, max_num_seqs=4)
    model = load_model(model_dir, TorchPagedAttention(), dtype=torch.float32, device=DEVICE)
    runner = ModelRunner(config, model)
    runner.initialize_kv_cache()
    return model, runner


def test_a_llamas_logits_are_the_same_with_the_layer_ops(tiny_checkpoint) -> None:
    model, runner = tiny_model(str(tiny_checkpoint))
    want = step_logits(runner, "without")
    ops = CountingOps()
    model.use_gpu_layer_ops(ops)
    # Only the layer ops change: no native CPU kernel, row kernel or native decode comes with them.
    assert model.cpu_kernels is None and model.native_decode is None
    assert all(m.row_weight is None for m in model.modules() if isinstance(m, Linear))
    got = step_logits(runner, "with")
    assert set(ops.calls) == {"add_rms_norm", "rope_", "silu_and_mul"}
    for got_step, want_step in zip(got, want, strict=True):
        torch.testing.assert_close(got_step, want_step, rtol=1e-4, atol=1e-4)
    model.use_gpu_layer_ops(None)
    assert all(getattr(m, "kernels", None) is None for m in model.modules())


def test_a_moe_model_takes_the_ops_in_its_sparse_blocks_and_stays_batch_invariant(checkpoint_factory) -> None:
    from bulkinfer.engine.attention import TorchPagedAttention
    from bulkinfer.engine.models import load_model

    model = load_model(str(checkpoint_factory(arch="qwen2_moe")), TorchPagedAttention(), device=DEVICE)
    model.use_gpu_layer_ops(OPS)
    blocks = model.sparse_blocks()
    assert blocks and all(block.kernels is OPS for block in blocks)
    assert all(expert.kernels is OPS for block in blocks for expert in block.experts)
    assert all(block.shared_expert.kernels is OPS for block in blocks)
    model.use_batch_invariance(True)
    # The ops leave the experts' matmuls to PyTorch: grouped_mm (tiled by row count) stays off.
    assert not any(block.grouped_mm_allowed for block in blocks)
