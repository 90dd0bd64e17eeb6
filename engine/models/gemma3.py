"""Gemma 3 text models (``Gemma3ForCausalLM``), built from llama.py's attention and projections.

What differs from Llama, after transformers' Gemma3 implementation (the reference we match):
- Layers are local (a sliding window) or global (full attention), from ``layer_types`` or the older
  ``sliding_window_pattern`` (every n-th layer global); each kind has its own rotary: local layers
  ``rope_local_base_freq`` without scaling, global ones ``rope_theta`` with the config's scaling.
- RMSNorm is ``norm(x) * (1 + weight)`` computed in fp32; four per layer (input, post-attention,
  pre- and post-feedforward), the attention and MLP outputs normed before joining the residual.
- q/k norms (Gemma's RMSNorm over head_dim) before rotary; attention scale
  ``query_pre_attn_scalar ** -0.5``. Every attention path and native kernel scales scores by
  ``head_dim ** -0.5``; the ratio of the two is folded into the q-norm's output (rotary is linear,
  so q is scaled exactly as the scores would be), rounded to the model dtype once, as q is in
  transformers: pre-scaling the rotated q instead adds a rounding that bf16 shows.
- Embeddings are multiplied by sqrt(hidden_size), rounded to the model dtype first.
- MLP: ``down(gelu_tanh(gate) * up)``.
- ``final_logit_softcapping``: logits = cap * tanh(logits / cap), in the LM head's dtype.
- ``attn_logit_softcapping`` is read but, as in transformers' Gemma3 (which never passes it to its
  attention functions), not applied: Gemma 3's checkpoints set it to null, and the reference
  ignores it when set.
The native decode path (decode_layers.c) runs the Llama layout only: Gemma 3 keeps the Python path.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from bulkinfer.engine.attention import AttentionBackend, AttentionMetadata
from bulkinfer.engine.invariant import in_row_blocks
from bulkinfer.engine.models.layers import MLP, FinalRows, RotaryEmbedding
from bulkinfer.engine.models.llama import Attention, LlamaForCausalLM
from bulkinfer.engine.models.llama_config import LlamaFamilyConfig, UnsupportedModelError

_GELU_TANH = ("gelu_pytorch_tanh",)  # every Gemma 3 checkpoint; transformers: F.gelu(approximate="tanh")


@dataclass(frozen=True)
class Gemma3Config(LlamaFamilyConfig):
    query_pre_attn_scalar: float = 256.0
    final_logit_softcapping: float | None = None
    local_rope_theta: float = 10000.0


def parse_gemma3_config(architecture: str, cfg: dict[str, Any]) -> Gemma3Config:
    num_layers = int(cfg["num_hidden_layers"])
    layer_types = cfg.get("layer_types")
    if not layer_types:
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                       for i in range(num_layers)]
    layer_types = list(layer_types)[:num_layers]  # a layer-skip draft keeps the first layers
    unknown = set(layer_types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise UnsupportedModelError(f"Gemma 3 layer types {sorted(unknown)} are not supported")
    activation = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if activation not in _GELU_TANH:
        raise UnsupportedModelError(f"Gemma 3 hidden_activation {activation!r} is not supported "
                                    f"(supported: {', '.join(_GELU_TANH)})")
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedModelError("Gemma 3 with use_bidirectional_attention is an encoder, not a decoder")
    global_rope, local_theta = _rope_parameters(cfg)
    base_cfg = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "rope_scaling", "layer_types")}
    base_cfg.update(rope_parameters=global_rope, hidden_act="silu")  # the Llama parser checks SiLU
    base = LlamaFamilyConfig.from_hf_dict(architecture, base_cfg)
    window = cfg.get("sliding_window")
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(LlamaFamilyConfig)}
    fields.update(
        qk_norm=True, hidden_act=activation,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        sliding_windows=tuple(int(window) if kind == "sliding_attention" and window else None
                              for kind in layer_types),
    )
    cap = cfg.get("final_logit_softcapping")
    return Gemma3Config(**fields, query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
                        final_logit_softcapping=None if cap is None else float(cap),
                        local_rope_theta=local_theta)


def _rope_parameters(cfg: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """(the global layers' rope parameters, the local layers' base) from either config format:
    transformers 5's ``rope_parameters`` per layer kind, or the Hub's ``rope_theta`` +
    ``rope_scaling`` (global) and ``rope_local_base_freq`` (local)."""
    per_kind = cfg.get("rope_parameters")
    if isinstance(per_kind, dict) and "full_attention" in per_kind:
        local = per_kind.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise UnsupportedModelError("Gemma 3 local layers with scaled rope are not supported")
        global_rope = dict(per_kind["full_attention"] or {})
        global_rope.setdefault("rope_theta", 1_000_000.0)
        return global_rope, float(local.get("rope_theta", 10000.0))
    global_rope = dict(cfg.get("rope_scaling") or {})
    global_rope["rope_theta"] = float(cfg.get("rope_theta", 1_000_000.0))
    return global_rope, float(cfg.get("rope_local_base_freq", 10000.0))


class GemmaRMSNorm(nn.Module):
    """``norm(x) * (1 + weight)`` in fp32, rounded to x's dtype once at the end (transformers' order)."""

    # Batch invariance: rows in fixed blocks (engine/invariant/row_blocks.py; no native kernel here).
    fixed_row_blocks: bool = False

    def __init__(self, size: int, eps: float, output_scale: float = 1.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size), requires_grad=False)
        self.eps = eps
        self.output_scale = output_scale  # the q-norm's: the attention scale's ratio to head_dim ** -0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return in_row_blocks(self._norm, x) if self.fixed_row_blocks else self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        gain = 1.0 + self.weight.float()
        if self.output_scale != 1.0:
            gain = gain * self.output_scale
        return (normed * gain).to(x.dtype)


class Gemma3MLP(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # no native kernel for its activation
        return self.down_proj(in_row_blocks(self.activation, gate_up) if self.fixed_row_blocks
                              else self.activation(gate_up))

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class Gemma3Attention(Attention):
    def __init__(self, config: Gemma3Config, layer_index: int, backend: AttentionBackend) -> None:
        super().__init__(config, layer_index, backend)
        scale_ratio = (config.query_pre_attn_scalar ** -0.5) * (config.head_dim ** 0.5)
        self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps, output_scale=scale_ratio)  # type: ignore[assignment]  # Gemma's norm scales by (1 + w): RMSNorm's call and weight
        self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)  # type: ignore[assignment]  # Gemma's norm scales by (1 + w): RMSNorm's call and weight


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: Gemma3Config, layer_index: int, backend: AttentionBackend) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.self_attn = Gemma3Attention(config, layer_index, backend)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.mlp = Gemma3MLP(config)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.is_sliding = config.sliding_windows[layer_index] is not None

    def forward(self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                metadata: AttentionMetadata, kv_cache: torch.Tensor, keep: FinalRows | None = None
                ) -> torch.Tensor:
        """The residual stream after this layer (of `keep`'s rows only, where given)."""
        attended = self.self_attn(self.input_layernorm(hidden), rope, metadata, kv_cache, keep)
        if keep is not None:
            hidden = hidden.index_select(0, keep.rows)
        hidden = hidden + self.post_attention_layernorm(attended)
        mlp_out = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp_out)


class Gemma3ForCausalLM(LlamaForCausalLM):
    decoder_layer_class = Gemma3DecoderLayer
    config: Gemma3Config

    def __init__(self, config: Gemma3Config, backend: AttentionBackend) -> None:
        super().__init__(config, backend)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)  # type: ignore[assignment]  # Gemma's norm scales by (1 + w): RMSNorm's call and weight
        # self.rotary (from LlamaForCausalLM) is the global layers' rotary; local layers have their own.
        self.local_rotary = RotaryEmbedding(dataclasses.replace(config, rope_theta=config.local_rope_theta,
                                                                rope_scaling=None))

    @staticmethod
    def parse_config(architecture: str, cfg: dict[str, Any]) -> Gemma3Config:
        return parse_gemma3_config(architecture, cfg)

    def fits_native_decode(self) -> bool:
        return False

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                kv_caches: list[torch.Tensor], num_layers: int | None = None,
                final_rows: FinalRows | None = None) -> torch.Tensor:
        self.step_rows.single = metadata.num_decodes
        embedded = self.embed_tokens(input_ids)
        # transformers keeps sqrt(hidden) as an fp32 scalar and rounds it to the weights' dtype.
        hidden = embedded * torch.tensor(self.config.hidden_size ** 0.5).to(embedded.dtype)
        global_rope = self.rotary(positions, hidden.dtype)
        local_rope = self.local_rotary(positions, hidden.dtype)
        layers = self.layers if num_layers is None else self.layers[:num_layers]
        last = len(layers) - 1
        for index, (layer, kv_cache) in enumerate(zip(layers, kv_caches, strict=True)):
            rope = local_rope if layer.is_sliding else global_rope
            hidden = layer(hidden, rope, metadata, kv_cache, final_rows if index == last else None)
        return self.norm(hidden)

    @property
    def final_logit_softcap(self) -> float | None:  # type: ignore[override]  # the base: a constant
        return self.config.final_logit_softcapping

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return softcap_logits(super().compute_logits(hidden), self.config.final_logit_softcapping)

    def expected_hf_tensors(self) -> dict[str, tuple[int, ...]]:
        shapes = super().expected_hf_tensors()
        for i in range(self.config.num_layers):
            for name in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
                shapes[f"model.layers.{i}.{name}.weight"] = (self.config.hidden_size,)
        return shapes

    @torch.no_grad()
    def load_hf_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        super().load_hf_tensors(tensors)
        for i, layer in enumerate(self.layers):
            for name in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
                getattr(layer, name).weight.copy_(tensors[f"model.layers.{i}.{name}.weight"])


def softcap_logits(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """transformers' final-logit soft-cap: ``cap * tanh(logits / cap)``; None: unchanged."""
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap
