"""How checkpoint tensors split over ranks (engine/parallel/plan.py), without starting any rank."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from bulkinfer.engine.models.llama_config import LlamaFamilyConfig
from bulkinfer.engine.parallel.plan import (
    Split,
    TensorParallelConfigError,
    check_splittable,
    local_config,
    shard,
)
from bulkinfer.engine.parallel.plans import llama_plan, moe_plan, phi3_plan

HEAD = 2


def rows(n: int) -> torch.Tensor:
    return torch.arange(n * 3, dtype=torch.float32).view(n, 3)


def parts(tensor: torch.Tensor, split: Split, world: int) -> list[torch.Tensor]:
    return [shard(tensor, tuple(tensor.shape), split, rank, world, "t") for rank in range(world)]


def test_heads_split_evenly_and_concatenate_back() -> None:
    weight = rows(4 * HEAD)
    got = parts(weight, Split(dim=0, unit=HEAD), 2)
    assert [p.shape[0] for p in got] == [4, 4]
    assert torch.equal(torch.cat(got), weight)


def test_fewer_kv_heads_than_ranks_are_replicated_to_the_ranks_whose_query_heads_use_them() -> None:
    kv = rows(2 * HEAD)  # 2 KV heads over 4 ranks: ranks 0-1 take head 0, ranks 2-3 head 1
    got = parts(kv, Split(dim=0, unit=HEAD), 4)
    for rank, part in enumerate(got):
        head = rank * 2 // 4
        assert torch.equal(part, kv[head * HEAD : (head + 1) * HEAD])


def test_a_fused_tensor_splits_each_section_and_keeps_their_order() -> None:
    fused = rows(4 * HEAD + 2 * HEAD + 2 * HEAD)  # q: 4 heads, k and v: 2 each
    got = parts(fused, Split(dim=0, sections=(8, 4, 4), unit=HEAD), 2)
    assert torch.equal(got[1], torch.cat([fused[4:8], fused[10:12], fused[14:16]]))


def test_a_vocabulary_that_does_not_divide_is_padded_with_zero_rows() -> None:
    vocab = rows(5)
    got = parts(vocab, Split(dim=0, pad=True), 2)
    assert [p.shape[0] for p in got] == [3, 3]
    assert torch.equal(got[1][:2], vocab[3:]) and not got[1][2].any()


def test_row_parallel_splits_the_input_dimension_and_a_bias_is_kept_once() -> None:
    weight = torch.arange(24.0).view(3, 8)
    assert torch.equal(parts(weight, Split(dim=1, unit=HEAD), 2)[1], weight[:, 4:])
    bias = torch.ones(3)
    assert [p.sum().item() for p in parts(bias, Split(dim=None, first_rank_only=True), 2)] == [3.0, 0.0]


def config(**changes: object) -> LlamaFamilyConfig:
    base = dict(architecture="LlamaForCausalLM", vocab_size=2049, hidden_size=64, intermediate_size=96,
                num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6,
                rope_theta=10000.0, max_position_embeddings=128, o_bias=True)
    return LlamaFamilyConfig(**{**base, **changes})


def test_a_rank_config_holds_its_share_of_heads_channels_and_vocabulary() -> None:
    local = local_config(config(), 4)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size, local.vocab_size) == (1, 1, 24, 513)
    assert local.hidden_size == 64 and local.head_dim == 16


def test_shapes_that_do_not_split_are_refused_naming_the_field() -> None:
    with pytest.raises(TensorParallelConfigError,
                       match="num_heads: 4 cannot be split evenly over tensor_parallel_size=3"):
        check_splittable(config(), 3)
    with pytest.raises(TensorParallelConfigError, match="num_kv_heads: 3 cannot be replicated evenly"):
        check_splittable(config(num_heads=12, num_kv_heads=3, intermediate_size=96), 4)


def test_the_llama_plan_names_every_split_tensor_and_its_all_reduces() -> None:
    plan = llama_plan(config())
    assert plan["model.layers.0.self_attn.o_proj.weight"].reduce_at == "layers.0.self_attn"
    assert plan["model.layers.0.mlp.down_proj.weight"].reduce_at == "layers.0.mlp"
    assert plan["model.layers.0.self_attn.o_proj.bias"].first_rank_only
    assert "model.layers.0.input_layernorm.weight" not in plan  # replicated
    assert plan["lm_head.weight"].pad and "lm_head.weight" not in llama_plan(config(tie_word_embeddings=True))


def test_the_phi3_plan_splits_the_fused_qkv_and_gate_up_section_by_section() -> None:
    c = config(num_layers=1)  # 4 query heads and 2 KV heads of 16, MLP width 96
    plan = phi3_plan(c)
    qkv = plan["model.layers.0.self_attn.qkv_proj.weight"]
    assert (qkv.sections, qkv.unit) == ((64, 32, 32), 16)
    fused = rows(128)
    rank1 = shard(fused, (128, 3), qkv, 1, 2, "qkv")
    assert torch.equal(rank1, torch.cat([fused[32:64], fused[80:96], fused[112:128]]))
    assert plan["model.layers.0.mlp.gate_up_proj.weight"].sections == (96, 96)
    assert plan["model.layers.0.mlp.down_proj.weight"].reduce_at == "layers.0.mlp"


def test_the_moe_plan_splits_each_expert_and_reduces_once_after_the_sparse_block() -> None:
    """Each expert (and the shared expert) by its intermediate channels, the router replicated;
    a dense layer among sparse ones keeps the dense MLP's plan (configs as engine/models/moe.py)."""
    base = config(num_layers=2)
    c = SimpleNamespace(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)},
                        tensor_names=("block_sparse_moe", ("w1", "w3", "w2")), sparse_layers=(True, False),
                        num_experts=2, shared_expert_intermediate_size=32)
    plan = moe_plan(c)
    block = "model.layers.0.block_sparse_moe."
    assert plan[block + "experts.1.w1.weight"] == Split(dim=0)
    assert plan[block + "experts.1.w2.weight"] == Split(dim=1, reduce_at="layers.0.mlp")
    assert plan[block + "shared_expert.down_proj.weight"].reduce_at == "layers.0.mlp"
    assert block + "gate.weight" not in plan and block + "shared_expert_gate.weight" not in plan
    assert plan["model.layers.1.mlp.down_proj.weight"].reduce_at == "layers.1.mlp"
    assert plan["model.layers.1.self_attn.o_proj.weight"].reduce_at == "layers.1.self_attn"
