"""The Llama family's config (the fields of an HF ``config.json`` its models read) and its rotary
frequencies; the models (engine/models/llama.py and the families built on it) and the modules that
only need the shapes (KV memory, the loader) import it from here."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch


class UnsupportedModelError(ValueError):
    """The checkpoint's config asks for something this implementation does not do."""


@dataclass(frozen=True)
class LlamaFamilyConfig:
    """The fields of an HF ``config.json`` that the Llama-family model needs."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: dict[str, Any] | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    # One entry per layer: the sliding-window size, or None for full attention.
    sliding_windows: tuple[int | None, ...] = field(default_factory=tuple)
    eos_token_ids: tuple[int, ...] = ()
    hidden_act: str = "silu"

    @staticmethod
    def from_hf_dict(architecture: str, cfg: dict[str, Any]) -> LlamaFamilyConfig:
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        num_layers = int(cfg["num_hidden_layers"])
        head_dim = cfg.get("head_dim") or hidden // num_heads
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) != 1.0:
            raise UnsupportedModelError("partial_rotary_factor != 1.0 is not supported")
        if rope_type not in _SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope scaling type {rope_type!r} is not supported "
                f"(supported: {sorted(_SUPPORTED_ROPE_TYPES)})"
            )
        rope_scaling = None if rope_type == "default" else {**rope, "rope_type": rope_type}
        if rope_scaling is not None and rope_type == "llama3":
            rope_scaling.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings"))
        hidden_act = cfg.get("hidden_act", "silu")
        if hidden_act not in ("silu", "swish"):
            raise UnsupportedModelError(f"hidden_act {hidden_act!r} is not supported (only silu)")

        is_qwen2 = architecture == "Qwen2ForCausalLM"
        attention_bias = bool(cfg.get("attention_bias", False))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return LlamaFamilyConfig(
            architecture=architecture,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rope_scaling=rope_scaling,
            # Qwen2: q/k/v bias always, o_proj bias never; Llama/Qwen3: attention_bias for all four.
            qkv_bias=True if is_qwen2 else attention_bias,
            o_bias=False if is_qwen2 else attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=architecture == "Qwen3ForCausalLM",
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            sliding_windows=_sliding_windows(architecture, cfg, num_layers),
            eos_token_ids=eos_ids,
            hidden_act=hidden_act,
        )


_SUPPORTED_ROPE_TYPES = {"default", "linear", "llama3"}


def _sliding_windows(architecture: str, cfg: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    window = cfg.get("sliding_window")
    if architecture == "MistralForCausalLM":
        return (window,) * num_layers
    layer_types = cfg.get("layer_types")
    if window is None or not layer_types or not cfg.get("use_sliding_window", True):
        return (None,) * num_layers
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types)


def rope_inverse_frequencies(config: LlamaFamilyConfig) -> torch.Tensor:
    """Same formula (and float ops) as transformers, so cos/sin match bit for bit. On the CPU, as
    transformers computes it, whatever device the model is built on (the loader builds on meta)."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(dtype=torch.float) / dim
    inv_freq = 1.0 / (config.rope_theta ** exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / float(scaling["factor"])
    # llama3: long wavelengths are divided by `factor`, medium ones interpolated smoothly.
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)
