"""The tensor-parallel plan of each model family (Megatron-style: column-parallel q/k/v and
gate/up, row-parallel o_proj and down_proj with one all-reduce after attention and one after the
MLP; a vocabulary-parallel embedding and LM head)."""

from __future__ import annotations

from typing import Any

from bulkinfer.engine.parallel.plan import Split


def vocab_splits(config: Any) -> dict[str, Split]:
    """The embedding and (untied) LM head: rows of the vocabulary, padded to a multiple of N."""
    splits = {"model.embed_tokens.weight": Split(dim=0, pad=True)}
    if not config.tie_word_embeddings:
        splits["lm_head.weight"] = Split(dim=0, pad=True)
    return splits


def attention_splits(config: Any, prefix: str, module: str, bias: bool, o_bias: bool) -> dict[str, Split]:
    """q/k/v by heads (KV heads replicated where fewer than ranks), o_proj by its input heads."""
    head = config.head_dim
    splits: dict[str, Split] = {}
    for name in ("q_proj", "k_proj", "v_proj"):
        splits[f"{prefix}{name}.weight"] = Split(dim=0, unit=head)
        if bias:
            splits[f"{prefix}{name}.bias"] = Split(dim=0, unit=head)
    splits[f"{prefix}o_proj.weight"] = Split(dim=1, unit=head, reduce_at=module)
    if o_bias:
        splits[f"{prefix}o_proj.bias"] = Split(dim=None, first_rank_only=True)
    return splits


def mlp_splits(prefix: str, module: str, bias: bool) -> dict[str, Split]:
    """gate/up by output channel, down_proj by input channel."""
    splits = {
        f"{prefix}gate_proj.weight": Split(dim=0),
        f"{prefix}up_proj.weight": Split(dim=0),
        f"{prefix}down_proj.weight": Split(dim=1, reduce_at=module),
    }
    if bias:
        splits[f"{prefix}gate_proj.bias"] = Split(dim=0)
        splits[f"{prefix}up_proj.bias"] = Split(dim=0)
        splits[f"{prefix}down_proj.bias"] = Split(dim=None, first_rank_only=True)
    return splits


def llama_plan(config: Any) -> dict[str, Split]:
    """Llama, Mistral, Qwen2, Qwen3 (q/k norms are per head: replicated)."""
    plan = vocab_splits(config)
    for i in range(config.num_layers):
        plan.update(attention_splits(config, f"model.layers.{i}.self_attn.", f"layers.{i}.self_attn",
                                     config.qkv_bias, config.o_bias))
        plan.update(mlp_splits(f"model.layers.{i}.mlp.", f"layers.{i}.mlp", config.mlp_bias))
    return plan


def phi3_plan(config: Any) -> dict[str, Split]:
    """Phi-3: the checkpoint's fused qkv_proj (q, k, v by heads) and gate_up_proj (gate, up)."""
    plan = vocab_splits(config)
    head = config.head_dim
    q, kv = config.num_heads * head, config.num_kv_heads * head
    for i in range(config.num_layers):
        prefix, attention, mlp = f"model.layers.{i}.", f"layers.{i}.self_attn", f"layers.{i}.mlp"
        plan[prefix + "self_attn.qkv_proj.weight"] = Split(dim=0, sections=(q, kv, kv), unit=head)
        plan[prefix + "self_attn.o_proj.weight"] = Split(dim=1, unit=head, reduce_at=attention)
        plan[prefix + "mlp.gate_up_proj.weight"] = Split(dim=0, sections=(config.intermediate_size,) * 2)
        plan[prefix + "mlp.down_proj.weight"] = Split(dim=1, reduce_at=mlp)
    return plan


def moe_plan(config: Any) -> dict[str, Split]:
    """Qwen3-MoE, Qwen2-MoE, Mixtral: attention as Llama's; each expert (and the shared expert) split
    by its intermediate channels, the router (and the shared expert's gate) replicated, and one
    all-reduce after the whole sparse block (its output is the sum of the ranks' partial sums)."""
    plan = vocab_splits(config)
    block, (gate, up, down) = config.tensor_names
    for i in range(config.num_layers):
        module = f"layers.{i}.mlp"
        plan.update(attention_splits(config, f"model.layers.{i}.self_attn.", f"layers.{i}.self_attn",
                                     config.qkv_bias, config.o_bias))
        if not config.sparse_layers[i]:
            plan.update(mlp_splits(f"model.layers.{i}.mlp.", module, config.mlp_bias))
            continue
        prefix = f"model.layers.{i}.{block}."
        for e in range(config.num_experts):
            plan[f"{prefix}experts.{e}.{gate}.weight"] = Split(dim=0)
            plan[f"{prefix}experts.{e}.{up}.weight"] = Split(dim=0)
            plan[f"{prefix}experts.{e}.{down}.weight"] = Split(dim=1, reduce_at=module)
        if config.shared_expert_intermediate_size:
            plan.update(mlp_splits(prefix + "shared_expert.", module, bias=False))
    return plan
