"""Mixture-of-experts layers (engine/models/moe.py): config parsing, the grouped expert computation
against a per-token reference, routing on the test checkpoints, and which decode paths MoE models
take (native decode: the Python path). The fixed-shape (CUDA-graph) path: test_moe_fixed_shape.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from bulkinfer.engine import LLM, cpu_kernels
from bulkinfer.engine.attention import TorchPagedAttention
from bulkinfer.engine.decode_graphs import decode_graph_mode
from bulkinfer.engine.models import UnsupportedModelError, load_model
from bulkinfer.engine.models.sparse_moe import MoeConfig, SparseMoeBlock
from bulkinfer.engine.models.step_rows import StepRows
from tests.engine.test_llm_correctness import MOE_PROMPTS

BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)


def test_qwen_config_reads_sparse_layers_normalisation_and_shared_expert():
    cfg = {**BASE, "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
           "decoder_sparse_step": 2, "mlp_only_layers": [3], "norm_topk_prob": True,
           "shared_expert_intermediate_size": 24}
    config = MoeConfig.from_hf_dict("Qwen2MoeForCausalLM", cfg)
    # (i + 1) % 2 == 0 for layers 1 and 3; layer 3 is listed dense.
    assert config.sparse_layers == (False, True, False, False)
    assert config.norm_topk_prob and not config.routing_weights_in_fp32 and config.qkv_bias
    assert config.shared_expert_intermediate_size == 24 and config.moe_intermediate_size == 16
    qwen3 = MoeConfig.from_hf_dict("Qwen3MoeForCausalLM", {**cfg, "sliding_window": 8})
    assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.sliding_windows == (None,) * 4  # window off
    assert not MoeConfig.from_hf_dict("Qwen3MoeForCausalLM", {**cfg, "norm_topk_prob": False}).norm_topk_prob


def test_mixtral_config_is_sparse_everywhere_renormalised_and_windowed():
    cfg = {**BASE, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 16}
    config = MoeConfig.from_hf_dict("MixtralForCausalLM", cfg)
    assert config.sparse_layers == (True,) * 4 and config.num_experts == 4
    assert config.norm_topk_prob and config.routing_weights_in_fp32 and config.mixtral_names
    assert config.moe_intermediate_size == 48 and config.sliding_windows == (16,) * 4


def test_a_top_k_beyond_the_experts_is_refused_by_name():
    cfg = {**BASE, "num_local_experts": 4, "num_experts_per_tok": 5}
    with pytest.raises(UnsupportedModelError, match="num_experts_per_tok=5"):
        MoeConfig.from_hf_dict("MixtralForCausalLM", cfg)


def random_block(config: MoeConfig, seed: int = 0) -> SparseMoeBlock:
    block = SparseMoeBlock(config, StepRows())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * param.shape[-1] ** -0.5)
    return block.requires_grad_(False)


def reference_moe(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """transformers' formula, one token at a time."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(block.gate.weight.matmul(x[t]).float(), dim=-1)
        weights, experts = torch.topk(probs, block.top_k)
        if block.norm_topk_prob:
            weights = weights / weights.sum()
        for weight, e in zip(weights, experts.tolist(), strict=True):
            expert = block.experts[e]
            gate, up = F.linear(x[t], expert.gate_up_proj.weight).chunk(2)
            out[t] += weight * F.linear(F.silu(gate) * up, expert.down_proj.weight)
        if block.shared_expert is not None:
            shared = block.shared_expert
            gate, up = F.linear(x[t], shared.gate_up_proj.weight).chunk(2)
            out[t] += torch.sigmoid(block.shared_expert_gate.weight @ x[t]) * F.linear(
                F.silu(gate) * up, shared.down_proj.weight)
    return out


@pytest.mark.parametrize("arch, extra", [
    ("MixtralForCausalLM", {"num_local_experts": 8, "num_experts_per_tok": 2}),
    ("Qwen3MoeForCausalLM", {"num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 16,
                             "norm_topk_prob": False}),
    ("Qwen2MoeForCausalLM", {"num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                             "norm_topk_prob": True, "shared_expert_intermediate_size": 40}),
])
def test_grouped_experts_equal_the_per_token_formula(arch, extra):
    block = random_block(MoeConfig.from_hf_dict(arch, {**BASE, **extra}))
    x = torch.randn(37, 32, generator=torch.Generator().manual_seed(1))
    x[5] = x[30]  # the same token twice: the same experts, the same result
    block.step_rows.single = 4  # leading decode rows, as a mixed step has them
    ours = block(x)
    torch.testing.assert_close(ours, reference_moe(block, x), rtol=1e-5, atol=1e-5)
    assert torch.equal(ours[5], ours[30])
    assert block(x[:0]).shape == (0, 32)  # a step whose last layer keeps no rows


def test_routing_on_the_test_checkpoints_spreads_over_every_expert(checkpoint_factory):
    """The seeded router weights are not degenerate: every expert of every sparse layer gets rows,
    none most of them, and the top-1 probability is rarely ~1 (routing decides something)."""
    for arch in ("qwen3_moe", "mixtral"):
        model = load_model(checkpoint_factory(arch=arch), TorchPagedAttention())
        hidden = model.embed_tokens(torch.tensor(sum(MOE_PROMPTS, [])))
        for layer in model.layers:
            block = layer.mlp
            if not isinstance(block, SparseMoeBlock):
                continue
            experts, weights = block.route(layer.post_attention_layernorm(hidden))
            share = torch.bincount(experts.flatten(), minlength=block.num_experts) / experts.numel()
            assert share.min() > 0.02 and share.max() < 0.4, (arch, share)
            assert float((weights[:, 0] > 0.95).float().mean()) < 0.2


def test_moe_models_decode_natively_on_cpu_and_capture_where_grouped_mm_allows(checkpoint_factory):
    llm = LLM(model=str(checkpoint_factory(arch="mixtral")), dtype="float32", num_kv_blocks=64)
    # fp32 on a CPU with the fp32 row kernel (AVX-512): the native decode driver runs the sparse
    # layers; without it (AVX2) the Python path does. No graph capture either way (CPU, fp32).
    kernels = cpu_kernels.load()
    native_here = kernels is not None and torch.float32 in kernels.row_gemm_dtypes
    assert (llm.engine.model.native_decode is not None) == native_here
    assert decode_graph_mode("cpu", None, llm.engine.model.graph_capturable) == (False, False)
    assert decode_graph_mode("cuda", None, capturable=False) == (False, False)
    assert decode_graph_mode("cuda", True, capturable=False) == (True, False)
    assert decode_graph_mode("cuda", None, capturable=True) == (True, True)
    assert decode_graph_mode("cpu", None, capturable=True) == (False, False)
    assert decode_graph_mode("cpu", True, capturable=True) == (True, False)


def test_the_expert_layout_is_the_published_checkpoints(checkpoint_factory):
    """Tensor names as Qwen3-30B-A3B and Mixtral-8x7B publish them (transformers reads the same files)."""
    names = {arch: set(load_model(checkpoint_factory(arch=arch), TorchPagedAttention()).expected_hf_tensors())
             for arch in ("qwen3_moe", "mixtral")}
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in names["qwen3_moe"]
    assert "model.layers.0.mlp.gate.weight" in names["qwen3_moe"]
    assert "model.layers.1.mlp.down_proj.weight" in names["qwen3_moe"]  # the dense layer among sparse
    assert "model.layers.3.block_sparse_moe.experts.0.w2.weight" in names["mixtral"]
    assert not any(".mlp." in name for name in names["mixtral"])


def test_a_moe_config_is_a_llama_family_config():
    """The runner, embedder and speculative decoding read the Llama-family fields of any config."""
    fields = {f.name for f in dataclasses.fields(MoeConfig)}
    assert {"num_layers", "num_kv_heads", "head_dim", "sliding_windows", "eos_token_ids"} <= fields
