"""Where each HF module an adapter may target lands in our fused model.

Our layers fuse q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``; a LoRA on ``q_proj``
updates the q slice of the fused output, one on Phi-3's own fused ``qkv_proj`` the whole of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from bulkinfer.engine.models.layers import MLP, Linear
from bulkinfer.engine.models.llama import LlamaForCausalLM
from bulkinfer.engine.models.phi3 import Phi3ForCausalLM


@dataclass(frozen=True)
class Target:
    """An HF module's place in one of our projections: output rows [offset, offset + size)."""

    projection: str  # our module's path, e.g. "layers.3.self_attn.qkv_proj"
    offset: int
    size: int
    in_features: int


def lora_targets(model: LlamaForCausalLM) -> dict[str, Target]:
    """HF module path (as PEFT names it after ``base_model.model.model.``, e.g.
    "layers.3.self_attn.q_proj") -> its target. Mixture-of-experts layers offer attention only."""
    c = model.config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    fused_checkpoint = isinstance(model, Phi3ForCausalLM)
    targets: dict[str, Target] = {}
    for i, layer in enumerate(model.layers):
        attn = f"layers.{i}.self_attn."
        qkv, o = attn + "qkv_proj", attn + "o_proj"
        if fused_checkpoint:
            targets[qkv] = Target(qkv, 0, q + 2 * kv, c.hidden_size)
        else:
            for name, offset, size in (("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)):
                targets[attn + name] = Target(qkv, offset, size, c.hidden_size)
        targets[o] = Target(o, 0, c.hidden_size, q)
        if not isinstance(layer.mlp, MLP):
            continue  # a sparse MoE block: its experts take no LoRA
        mlp = f"layers.{i}.mlp."
        inter = layer.mlp.intermediate_size
        gate_up, down = mlp + "gate_up_proj", mlp + "down_proj"
        if fused_checkpoint:
            targets[gate_up] = Target(gate_up, 0, 2 * inter, c.hidden_size)
        else:
            targets[mlp + "gate_proj"] = Target(gate_up, 0, inter, c.hidden_size)
            targets[mlp + "up_proj"] = Target(gate_up, inter, inter, c.hidden_size)
        targets[down] = Target(down, 0, c.hidden_size, inter)
    return targets


def projection_modules(model: LlamaForCausalLM, targets: dict[str, Target]) -> dict[str, Linear]:
    """Our projection modules the targets land in, by path."""
    modules: dict[str, nn.Module] = dict(model.named_modules())
    found: dict[str, Linear] = {}
    for target in targets.values():
        module = modules[target.projection]
        assert isinstance(module, Linear), target.projection
        found[target.projection] = module
    return found
