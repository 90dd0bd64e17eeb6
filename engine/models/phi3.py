"""Phi-3 / Phi-4-mini (``Phi3ForCausalLM``): the Llama layout with fused checkpoint tensors.

What differs from Llama, and where it is handled:
- The checkpoint stores ``qkv_proj`` and ``gate_up_proj`` already fused, in our modules' order
  ([q; k; v] and [gate; up]): they load as they are.
- Rotary may cover only the first ``partial_rotary_factor`` of each head (Phi-4-mini: 0.75); the
  rest of the head passes through unrotated.
- ``longrope`` scaling: per-frequency ``short_factor`` / ``long_factor`` divisors and one attention
  factor multiplying cos and sin, computed as transformers computes them. Which factors: per
  position, the long ones from ``original_max_position_embeddings`` on (a cached block's keys then
  depend on their positions only, as prefix caching needs). transformers' forward picks them per
  pass (long once the pass reaches that position): the same for every sequence within the original
  context, and token by token past it (tested). Its ``generate`` goes further: when a sequence
  crosses the original context it drops its cache and re-encodes everything with the long
  factors, and a prompt longer than it is encoded with the long factors throughout; tokens after
  such a crossing can differ from ``generate``'s (not from its cached forward).
- ``sliding_window`` (when set) applies to every layer.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from bulkinfer.engine.attention import AttentionBackend
from bulkinfer.engine.models.layers import apply_rope
from bulkinfer.engine.models.llama import Attention, DecoderLayer, LlamaForCausalLM
from bulkinfer.engine.models.llama_config import LlamaFamilyConfig, UnsupportedModelError
from bulkinfer.engine.parallel.plan import Split
from bulkinfer.engine.parallel.plans import phi3_plan


@dataclass(frozen=True)
class LongRope:
    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    attention_factor: float


@dataclass(frozen=True)
class Phi3Config(LlamaFamilyConfig):
    rotary_dim: int = 0  # rotated leading dims of each head (head_dim unless partial rotary)
    longrope: LongRope | None = None


def parse_phi3_config(architecture: str, cfg: dict[str, Any]) -> Phi3Config:
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type in ("su", "yarn"):  # transformers' Phi3Config renames both to longrope
        rope_type = "longrope"
    if rope_type not in ("default", "longrope"):
        raise UnsupportedModelError(f"Phi-3 rope scaling type {rope_type!r} is not supported "
                                    "(supported: default, longrope)")
    partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    # The Llama parser reads everything else; rotary is ours.
    rope_keys = ("rope_parameters", "rope_scaling", "partial_rotary_factor")
    base_cfg = {k: v for k, v in cfg.items() if k not in rope_keys}
    base_cfg["rope_theta"] = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    base = LlamaFamilyConfig.from_hf_dict(architecture, base_cfg)
    rotary_dim = int(base.head_dim * partial)
    if rotary_dim % 2 or rotary_dim <= 0:
        raise UnsupportedModelError(f"partial_rotary_factor {partial} gives an odd rotary size {rotary_dim}")
    window = cfg.get("sliding_window")
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(LlamaFamilyConfig)}
    fields["sliding_windows"] = (None if window is None else int(window),) * base.num_layers
    return Phi3Config(**fields, rotary_dim=rotary_dim,
                      longrope=_longrope(rope, cfg, rotary_dim) if rope_type == "longrope" else None)


def _longrope(rope: dict[str, Any], cfg: dict[str, Any], rotary_dim: int) -> LongRope:
    original = int(rope.get("original_max_position_embeddings")
                   or cfg.get("original_max_position_embeddings") or cfg["max_position_embeddings"])
    short, long = tuple(map(float, rope["short_factor"])), tuple(map(float, rope["long_factor"]))
    if len(short) != rotary_dim // 2 or len(long) != rotary_dim // 2:
        raise UnsupportedModelError(f"longrope factors need {rotary_dim // 2} entries each, "
                                    f"got {len(short)} short and {len(long)} long")
    # transformers' _compute_longrope_parameters: the factor is the context extension unless given.
    factor = rope.get("factor")
    if factor is None:
        factor = int(cfg["max_position_embeddings"]) / original
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return LongRope(short, long, original, float(attention_factor))


class Phi3RotaryEmbedding(nn.Module):
    """cos/sin ``[T, 1, rotary_dim / 2]`` with transformers' float ops (so fp32 bits match)."""

    def __init__(self, config: Phi3Config) -> None:
        super().__init__()
        dim, base = config.rotary_dim, config.rope_theta
        # Plain attributes on the CPU (not buffers): model.to(bf16) must not round them.
        self.longrope = config.longrope
        if self.longrope is None:
            self.short = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim))
            self.long = self.short
            self.attention_factor = 1.0
        else:
            shape = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
            powers = base ** shape
            short, long = (torch.tensor(factors, dtype=torch.float32, device="cpu")
                           for factors in (self.longrope.short_factor, self.longrope.long_factor))
            self.short, self.long = 1.0 / (short * powers), 1.0 / (long * powers)
            self.attention_factor = self.longrope.attention_factor

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.short.device != positions.device:
            self.short, self.long = self.short.to(positions.device), self.long.to(positions.device)
        pos = positions[:, None].float()
        freqs = pos * self.short[None, :]
        if self.longrope is not None:
            is_long = positions[:, None] >= self.longrope.original_max_position_embeddings
            freqs = torch.where(is_long, pos * self.long[None, :], freqs)
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


class Phi3Attention(Attention):
    def __init__(self, config: Phi3Config, layer_index: int, backend: AttentionBackend) -> None:
        super().__init__(config, layer_index, backend)
        self.rotary_dim = config.rotary_dim

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.rotary_dim == x.shape[-1]:
            return super().rotate(x, cos, sin)
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        out[..., : self.rotary_dim] = apply_rope(x[..., : self.rotary_dim], cos, sin, self.kernels)
        out[..., self.rotary_dim:] = x[..., self.rotary_dim:]
        return out


class Phi3DecoderLayer(DecoderLayer):
    attention_class = Phi3Attention


_FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


class Phi3ForCausalLM(LlamaForCausalLM):
    decoder_layer_class = Phi3DecoderLayer
    config: Phi3Config

    def __init__(self, config: Phi3Config, backend: AttentionBackend) -> None:
        super().__init__(config, backend)
        self.rotary = Phi3RotaryEmbedding(config)  # type: ignore[assignment]  # LongRoPE: the same call

    @staticmethod
    def parse_config(architecture: str, cfg: dict[str, Any]) -> Phi3Config:
        return parse_phi3_config(architecture, cfg)

    def tensor_parallel_plan(self) -> dict[str, Split]:
        """The checkpoint's fused qkv and gate_up split section by section (engine/parallel/plans.py)."""
        return phi3_plan(self.config)

    def qkv_sources(self) -> tuple[str, ...]:
        return ("qkv",)  # the checkpoint's own fused projections

    def gate_up_sources(self) -> tuple[str, ...]:
        return ("gate_up",)

    def fits_native_decode(self) -> bool:
        # decode_layers.c rotates whole heads; cos/sin come from self.rotary, so longrope fits.
        return self.config.rotary_dim == self.config.head_dim

    def expected_hf_tensors(self) -> dict[str, tuple[int, ...]]:
        """Llama's names with q/k/v and gate/up as the checkpoint's fused tensors."""
        shapes = super().expected_hf_tensors()
        for i in range(self.config.num_layers):
            prefix = f"model.layers.{i}."
            for fused, parts in _FUSED.items():
                rows = sum(shapes.pop(f"{prefix}{part}.weight")[0] for part in parts)
                shapes[f"{prefix}{fused}.weight"] = (rows, self.config.hidden_size)
        return shapes

    @torch.no_grad()
    def load_hf_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Split the fused tensors into Llama's names (our fused modules concatenate them back)."""
        c = self.config
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        sizes = {"self_attn.qkv_proj": (q, kv, kv), "mlp.gate_up_proj": (c.intermediate_size,) * 2}
        split = dict(tensors)
        for i in range(c.num_layers):
            prefix = f"model.layers.{i}."
            for fused, parts in _FUSED.items():
                pieces = split.pop(f"{prefix}{fused}.weight").split(sizes[fused])
                split.update({f"{prefix}{part}.weight": piece
                              for part, piece in zip(parts, pieces, strict=True)})
        super().load_hf_tensors(split)
