"""The Llama family (Llama, Mistral, Qwen2, Qwen3) over a flattened, unpadded batch.

The model sees one "super-sequence" per step: token ids ``[T]`` and positions ``[T]`` of every
scheduled request, an attention-metadata object that says where each request's tokens and KV
blocks are, and one paged KV tensor per layer. It returns hidden states ``[T, hidden]``, or only the
rows a step samples from (``FinalRows``: the last layer then computes everything after its K/V for
those rows alone); the runner applies the LM head to the sampled rows (``compute_logits``).

Weights are loaded from Hugging Face tensor names; q/k/v and gate/up are fused into one matmul
each because two larger matmuls are faster than five small ones on CPU.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from bulkinfer.engine.attention import AttentionBackend, AttentionMetadata
from bulkinfer.engine.invariant import LOGIT_BLOCK_ROWS, in_row_blocks, in_step_row_blocks
from bulkinfer.engine.models.module_list import ModuleSeq
from bulkinfer.engine.models.native_decode import NativeDecode
from bulkinfer.engine.models.step_rows import StepRows
from bulkinfer.engine.parallel.plan import Split
from bulkinfer.engine.parallel.plans import llama_plan
from bulkinfer.engine.quant.linear import QuantizedLinear

if TYPE_CHECKING:
    from bulkinfer.engine.cpu_kernels import CpuKernels
    from bulkinfer.engine.gpu_kernels.layer_ops import TritonLayerOps
    from bulkinfer.engine.lora.slots import LoRASlots


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


class RMSNorm(nn.Module):
    kernels: CpuKernels | TritonLayerOps | None = None  # use_cpu_kernels / use_gpu_layer_ops
    # Batch invariance without the native kernel: rows in fixed blocks (engine/invariant/row_blocks.py).
    fixed_row_blocks: bool = False

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``norm(x)``; with the residual stream: ``residual += x`` (in x's dtype, in place), then
        ``(norm(residual), residual)`` — one pass on CPU in bf16 and fp32 (engine/cpu_kernels)."""
        if self.kernels is not None and self.kernels.layer_ops_apply(x):
            return self.kernels.add_rms_norm(x, residual, self.weight, self.eps)
        if residual is not None:
            residual = residual.add_(x)
            return self._norm_rows(residual), residual
        return self._norm_rows(x)

    def _norm_rows(self, x: torch.Tensor) -> torch.Tensor:
        return in_row_blocks(self._norm, x) if self.fixed_row_blocks else self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # The fused kernel: 3x faster than transformers' five-op formula, and bitwise equal to
            # it in fp32 on our CPUs (measured).
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # bf16/fp16: normalize in fp32, round to the model dtype, then scale — transformers' order
        # of roundings (the fused kernel scales before rounding, 1 ulp off on many elements).
        normalized = F.rms_norm(x.float(), self.weight.shape, None, self.eps)
        return normalized.to(x.dtype).mul_(self.weight)


class RotaryEmbedding(nn.Module):
    def __init__(self, config: LlamaFamilyConfig) -> None:
        super().__init__()
        # A plain attribute, not a buffer: model.to(bf16) must not round the frequencies.
        self.inv_freq = rope_inverse_frequencies(config)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, 1, head_dim / 2], broadcastable over heads.

        transformers builds cos/sin over ``cat(freqs, freqs)``; both halves are equal, so one is kept.
        """
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        return freqs.cos().to(dtype)[:, None, :], freqs.sin().to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               kernels: CpuKernels | TritonLayerOps | None = None) -> torch.Tensor:
    """transformers' ``x * cos + rotate_half(x) * sin``, per half and without the concatenations:
    the same products and sums (so the same fp32 results) in about half the memory traffic. With
    ``kernels`` (bf16 or fp32 on CPU): in place, in one pass."""
    heads_packed = x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]
    if kernels is not None and kernels.layer_ops_apply(x) and heads_packed:
        return kernels.rope_(x, cos, sin)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out1, out2 = out[..., :half], out[..., half:]
    torch.mul(x1, cos, out=out1)
    out1.sub_(x2 * sin)
    torch.mul(x2, cos, out=out2)
    out2.add_(x1 * sin)
    return out


@dataclass(frozen=True)
class FinalRows:
    """The positions whose final hidden state a step uses (its sampled ones). Every row needs every
    layer's K/V, but no row reads another's last-layer output: the last layer's attention output
    projection and MLP run on these rows alone, which in a prefill step of 4,096 tokens and a few
    sampled ones is ~3% of the step's matmul FLOPs (the MLP is three quarters of a layer's)."""

    rows: torch.Tensor  # flat positions, ascending (the batch's order: single-token rows first)
    num_single: int  # how many of them are single-token rows
    order: torch.Tensor  # the sampled positions' own order: wanted[i] = output[order[i]]


class Linear(nn.Linear):
    """nn.Linear that runs its rows through the fastest kernel measured for them on CPU.

    - oneDNN with a pre-packed weight (``pack_for_onednn``) for the rows of prefill chunks: on our
      AVX-512 CPUs its fp32 GEMM runs 1.3-2x faster than the MKL sgemm behind ``F.linear`` on AMD
      (MKL takes its AVX2 path on non-Intel CPUs), and at prefill sizes it beats both ``torch.mm``
      and the row kernel in the engine on Intel too (measured on whole workloads).
    - The row kernel (engine/cpu_kernels/row_gemm.c, where ``use_row_gemm`` applies: bf16 on AMX or
      AVX512-BF16, fp32 with AVX-512) for single-token rows (decodes, verified drafts; the LM head's
      sampled rows): it streams the weights at memory speed where oneDNN reads them at about half
      of it (1.2-1.5x faster at 1-64 rows), and it computes each row alone, so a row gets the same
      bits whatever else its step holds. oneDNN does not: in bf16 it takes a slower non-AMX kernel
      for 33-600 rows whose sums round differently. In a step with prefill rows, oneDNN computes
      every row and the row kernel then rewrites the single-token ones.
    Results are in the weight's dtype, differing from ``F.linear`` only in summation order.
    """

    packed_weight: torch.Tensor | None = None
    row_weight: torch.Tensor | None = None
    row_kernels: CpuKernels | None = None
    step_rows: StepRows | None = None  # None: every row is a single-token row (the LM head's rows)
    # forward_fp32's fp32 copy of the weight (and the weight it copies), where no kernel gives fp32 sums
    _fp32_weight: tuple[torch.Tensor, int, torch.Tensor] | None = None
    lora_slots: LoRASlots | None = None  # adapters' A and B for this projection (engine/lora/slots.py)
    # Batch invariance where the row kernel does not run: rows in fixed blocks (engine/invariant/).
    fixed_row_blocks: bool = False
    # ... and the step's rows this projection sees in order (its single-token rows first), whose
    # prefill rows then take larger blocks; None: every row in the smaller ones (the LM head's
    # sampled rows, an MoE expert's routed ones).
    blocks_by_step: StepRows | None = None

    def pack_for_onednn(self, batch_hint: int = 64) -> None:
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), batch_hint)

    def use_row_gemm(self, kernels: CpuKernels | None, step_rows: StepRows | None) -> bool:
        """Run single-token rows through the row kernel (packing the weight for it); None (or an
        unsupported weight): every row through oneDNN / PyTorch again. ``step_rows`` None: every
        row is a single-token row, and oneDNN's copy of the weight is dropped. Returns whether the
        row kernel is in use."""
        if kernels is None or not kernels.supports_row_gemm(self.weight):
            self.row_weight = self.row_kernels = self.step_rows = None
            return False
        self.row_weight = kernels.pack_row_gemm(self.weight.detach())
        self.row_kernels, self.step_rows = kernels, step_rows
        if step_rows is None:
            self.packed_weight = None
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._base_forward(x)
        if self.lora_slots is not None:
            rows = self.lora_slots.step_rows.lora
            if rows is not None:
                return self.lora_slots.add_updates(x, out, rows)
        return out

    def _base_forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_weight is not None and x.dim() == 2:
            return self._by_rows(x)
        if self.fixed_row_blocks and x.dim() == 2:
            single = self.blocks_by_step.single if self.blocks_by_step is not None else None
            return in_step_row_blocks(self._library_rows, x, single)
        return self._library_rows(x)

    def _library_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x``'s rows through oneDNN (a packed weight) or ``F.linear``."""
        if self.packed_weight is not None and x.dim() == 2:
            if x.shape[0] == 1:
                # oneDNN takes another kernel for one row, whose sums can round differently from the
                # same row in a batch (seen in bf16): run it as two rows, so a lone decode and a
                # batched one (or speculative verification's rows) get the same bits.
                return self._onednn(x.expand(2, -1).contiguous())[:1]
            return self._onednn(x)
        return F.linear(x, self.weight, self.bias)

    def forward_fp32(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``self(x)`` with each output the fp32 sum of its products, never rounded to a bf16/fp16
        weight's dtype: the LM head's logits, so sampling, logprobs and penalties see fp32's margins
        (rounded to bf16, a 0.1 margin between two tokens can become an exact tie). ``out``: an fp32
        ``[rows, out_features]`` tensor the row kernel writes into (elsewhere ignored)."""
        if self.weight.dtype == torch.float32:
            return self(x.float())
        if self.row_weight is not None and self.row_kernels is not None and x.dim() == 2:
            return self.row_kernels.row_gemm(x, self.row_weight, self.out_features, self.bias, out=out,
                                             fp32_out=True)
        flat = x.reshape(-1, x.shape[-1])
        if self.fixed_row_blocks:
            out = in_row_blocks(self._fp32_sums, flat, LOGIT_BLOCK_ROWS)
        else:
            out = self._fp32_sums(flat)
        if self.bias is not None:
            out += self.bias.float()
        return out.reshape(*x.shape[:-1], self.out_features)

    def _fp32_sums(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat [rows, in]`` (bf16/fp16) times the weight, the fp32 sums unrounded (no bias)."""
        if flat.is_cuda:  # cuBLAS accumulates in fp32 and hands the sums over as they are
            return torch.mm(flat, self.weight.t(), out_dtype=torch.float32)
        # no kernel with fp32 results here: the same products from an fp32 copy of the weight
        cached = self._fp32_weight  # a new or rewritten weight gets a new copy
        if cached is None or cached[0] is not self.weight or cached[1] != self.weight._version:
            cached = self._fp32_weight = (self.weight, self.weight._version, self.weight.detach().float())
        return F.linear(flat.float(), cached[2])

    def _onednn(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def _by_rows(self, x: torch.Tensor) -> torch.Tensor:
        assert self.row_kernels is not None and self.row_weight is not None
        rows = x.shape[0]
        step_rows = self.step_rows
        single = rows if step_rows is None or step_rows.every_row else min(step_rows.single, rows)
        if single == rows:
            return self.row_kernels.row_gemm(x, self.row_weight, self.out_features, self.bias)
        # oneDNN has no output argument: it computes the single-token rows too (few, beside a chunk),
        # which the row kernel then overwrites, cheaper than copying the chunk's rows out of its result.
        out = self._onednn(x) if self.packed_weight is not None else F.linear(x, self.weight, self.bias)
        if single:
            self.row_kernels.row_gemm(x[:single], self.row_weight, self.out_features, self.bias,
                                      out=out[:single])
        return out


def onednn_linear_available(device: torch.device, dtype: torch.dtype) -> bool:
    # bf16 too: packed bf16 weights run 1.1-1.4x faster than F.linear's bf16 path at decode sizes
    # (measured on AVX512-BF16). Not fp16: oneDNN has no fast fp16 path on these CPUs. Not bf16 where
    # oneDNN has no bf16 path at all (AVX2-only CPUs, or a cap below AVX-512: packing refuses there,
    # "bf16 path needs avx_ne_convert or avx512bw"); F.linear computes it instead.
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and (dtype != torch.bfloat16 or _onednn_has_bf16())
    )


@functools.cache
def _onednn_has_bf16() -> bool:
    """Whether oneDNN runs bf16 on this CPU (as capped by ONEDNN_MAX_CPU_ISA)."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check()) if check is not None else False


class Attention(nn.Module):
    kernels: CpuKernels | TritonLayerOps | None = None  # use_cpu_kernels / use_gpu_layer_ops
    step_rows: StepRows  # the model's, shared with its projections: set by LlamaForCausalLM

    def __init__(self, config: LlamaFamilyConfig, layer_index: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.sliding_window = config.sliding_windows[layer_index] if config.sliding_windows else None
        self.backend = backend

    def forward(
        self,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
        kv_cache: torch.Tensor,
        keep: FinalRows | None = None,
    ) -> torch.Tensor:
        """The attention output of every row, or of `keep.rows` only (every row's K/V is written
        to the cache either way)."""
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        cos, sin = rope
        q = self.rotate(q, cos, sin)
        k = self.rotate(k, cos, sin)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        self.backend.write_kv(k, v, k_cache, v_cache, metadata)
        out = self.backend.forward(
            q, k_cache, v_cache, metadata, sliding_window=self.sliding_window, key=k, value=v
        )
        out = out.view(num_tokens, self.q_size)
        if keep is not None:
            out = out.index_select(0, keep.rows)
            # From here on the layer's rows are the kept ones, their single-token rows first.
            self.step_rows.single = keep.num_single
            if self.step_rows.lora is not None:
                self.step_rows.lora = self.step_rows.lora.select(keep.rows)
        return self.o_proj(out)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary embedding of q or k ``[T, heads, head_dim]`` (a family with partial rotary overrides it)."""
        return apply_rope(x, cos, sin, self.kernels)


class MLP(nn.Module):
    kernels: CpuKernels | TritonLayerOps | None = None  # use_cpu_kernels / use_gpu_layer_ops
    # Batch invariance without the native kernel: the activation in fixed row blocks (torch's fp32
    # SiLU takes a scalar path for a call's last elements, whose exp rounds differently).
    fixed_row_blocks: bool = False

    def __init__(self, config: LlamaFamilyConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.kernels is not None and self.kernels.layer_ops_apply(gate_up):
            return self.down_proj(self.kernels.silu_and_mul(gate_up))
        return self.down_proj(in_row_blocks(self.activation, gate_up) if self.fixed_row_blocks
                              else self.activation(gate_up))

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``act(gate) * up`` of the fused gate/up projection's output."""
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return F.silu(gate).mul_(up)


class DecoderLayer(nn.Module):
    attention_class: type[Attention] = Attention  # a family's own attention (e.g. partial rotary)

    def __init__(self, config: LlamaFamilyConfig, layer_index: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = self.attention_class(config, layer_index, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
        kv_cache: torch.Tensor,
        keep: FinalRows | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output, the residual stream before it): each residual add happens inside
        the norm that follows it (vLLM's layout), so the pair can be one fused op. `keep`: the output
        (and residual) of its rows only."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rope, metadata, kv_cache, keep)
        if keep is not None:
            residual = residual.index_select(0, keep.rows)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    """Llama / Mistral / Qwen2 / Qwen3 decoder over a flattened batch with a paged KV cache."""

    decoder_layer_class: type[nn.Module] = DecoderLayer  # a family's own layer (Gemma 3, Phi-3)
    final_logit_softcap: float | None = None  # logits = cap * tanh(logits / cap) where set (Gemma)
    _logits_buffer: torch.Tensor | None = None  # compute_logits' output on CPU, kept between steps
    config_class = LlamaFamilyConfig  # parses config.json for this class (the loader calls from_hf_dict)
    tensor_parallel_size = 1  # the ranks one model is split over (engine/parallel/loading.py sets it)

    def __init__(self, config: LlamaFamilyConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers: ModuleSeq[DecoderLayer] = ModuleSeq(
            self.decoder_layer_class(config, i, backend) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        self.step_rows = StepRows()
        for layer in self.layers:
            layer.self_attn.step_rows = self.step_rows
        self.native_decode: NativeDecode | None = None  # set by use_cpu_kernels where it applies
        self.cpu_kernels: CpuKernels | None = None  # likewise (None: PyTorch everywhere)
        self.requires_grad_(False)

    @classmethod
    def parse_config(cls, architecture: str, cfg: dict[str, Any]) -> LlamaFamilyConfig:
        """This class's config from an HF ``config.json`` dict (a family with more fields overrides it,
        or names its ``config_class``)."""
        return cls.config_class.from_hf_dict(architecture, cfg)

    def fits_native_decode(self) -> bool:
        """Whether the layers are the plain Llama layout decode_layers.c runs (full rotary, the
        head_dim ** -0.5 scale, two norms, SiLU MLP); a family that differs overrides it."""
        return True

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        kv_caches: list[torch.Tensor],
        num_layers: int | None = None,
        final_rows: FinalRows | None = None,
    ) -> torch.Tensor:
        """`num_layers`: run only the first that many decoder layers (start-up profiling: every
        layer's activations are the same size, so the first few show the peak). `final_rows`: return
        those rows' hidden states only ([len(rows), hidden], ascending), computing the last layer's
        output for them alone."""
        self.step_rows.single = metadata.num_decodes
        lora = self.step_rows.lora
        # A step with adapter rows runs here where decode_layers.c has the adapters' slots.
        images = self.step_rows.images
        if self.native_decode is not None and metadata.num_prefills == 0 and not metadata.fixed_shape \
                and (lora is None or self.native_decode.has_lora) and images is None \
                and self.step_rows.rope_rows is None:
            layers_out = self.native_decode.run(input_ids, positions, metadata, kv_caches,
                                                lora.slots if lora is not None else None)
            if layers_out is not None:
                hidden = self.norm(*layers_out)[0]
                return hidden if final_rows is None else hidden.index_select(0, final_rows.rows)
        hidden = self.embed_tokens(input_ids)
        if images is not None:
            hidden.index_copy_(0, images.flat_index, images.embeds.to(hidden.dtype))
        rope = self.step_rope(self.rotary(positions, hidden.dtype), hidden.dtype)
        residual = None
        layers = self.layers if num_layers is None else self.layers[:num_layers]
        last = len(layers) - 1
        for index, (layer, kv_cache) in enumerate(zip(layers, kv_caches, strict=True)):
            keep = final_rows if index == last else None
            hidden, residual = layer(hidden, residual, rope, metadata, kv_cache, keep)
        return self.norm(hidden, residual)[0]

    def step_rope(self, rope: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor,
                                                                                            torch.Tensor]:
        """The step's cos/sin: a family with positions of its own (M-RoPE) changes some rows."""
        return rope

    @staticmethod
    def normalize_tensor_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A family whose checkpoints name tensors two ways reads both (Qwen2.5-VL)."""
        return tensors

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits (what sampling, penalties, grammar masks and logprobs work on), in every
        compute dtype: the LM head's fp32 sums, never rounded to bf16 on the way. On CPU they are
        written into one buffer kept for the next call (a step's logits are used up within the
        step): 256 rows of a 49k vocabulary are 50 MB, which a fresh tensor would map and fault in
        page by page every step (2x the head's time at 256 rows)."""
        rows = hidden.shape[0] if hidden.dim() == 2 else 0
        out = None
        if rows and hidden.device.type == "cpu":
            if self._logits_buffer is None or self._logits_buffer.shape[0] < rows:
                self._logits_buffer = torch.empty(rows, self.config.vocab_size, dtype=torch.float32)
            out = self._logits_buffer[:rows]
        return self.lm_head.forward_fp32(hidden, out=out)

    def use_cpu_kernels(self, kernels: CpuKernels | None) -> None:
        """Run norms, rotary, the MLP activation and single-token rows' projections through the
        native kernels (on CPU, in the dtypes each supports; the rest keeps PyTorch); None: PyTorch
        everywhere (projections unpacked by the row kernel fall back to ``F.linear``)."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, MLP)):
                module.kernels = kernels
            if isinstance(module, Linear):
                # The LM head's rows are the sampled positions: every one a row of its own.
                module.use_row_gemm(kernels, None if module is self.lm_head else self.step_rows)
            if isinstance(module, QuantizedLinear):
                module.use_kernels(kernels, self.step_rows)
        self.cpu_kernels = kernels
        self.native_decode = NativeDecode.for_model(self, kernels)

    def use_gpu_layer_ops(self, ops: TritonLayerOps | None) -> None:
        """Run norms (with their residual add), rotary and the MLP activation through Triton
        (engine/gpu_kernels/layer_ops.py) where its ``layer_ops_apply`` says so (CUDA tensors); None:
        PyTorch for them. Only those modules' ``kernels`` change (replacing what use_cpu_kernels set
        there): projections, the native decode path and LoRA keep theirs, as they call CpuKernels'
        other methods. The ops compute each row alone, so batch invariance needs no fixed row blocks
        for them and holds with them on (use_batch_invariance composes in either order)."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, MLP)):
                module.kernels = ops

    def use_batch_invariance(self, on: bool) -> None:
        """Batch invariance (engine/config.py ``batch_invariant``): every projection row through the row
        kernel where it runs, and where no native kernel runs an op (the kernels off, a GPU) its
        rows in fixed blocks (engine/invariant/). Attention's part is the backend's own setting."""
        self.step_rows.every_row = on
        for module in self.modules():
            if hasattr(type(module), "fixed_row_blocks"):
                setattr(module, "fixed_row_blocks", on)  # noqa: B010 - any module's own flag
        for layer in self.layers:
            for module in layer.modules():
                if isinstance(module, Linear):
                    module.blocks_by_step = self.step_rows if on else None

    def pack_linear_weights(self, batch_hint: int = 64) -> None:
        """Switch every projection to oneDNN with packed weights (call after loading weights)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack_for_onednn(batch_hint)

    def tensor_parallel_plan(self) -> dict[str, Split]:
        """How each checkpoint tensor splits over tensor-parallel ranks (engine/parallel/plan.py)."""
        return llama_plan(self.config)

    def projection_sources(self) -> dict[str, tuple[str, ...]]:
        """Each projection module (our path) and the checkpoint's linear layers it concatenates, in
        order: what a quantized checkpoint's layers become (engine/models/loader.py)."""
        sources: dict[str, tuple[str, ...]] = {"lm_head": ("lm_head",)}
        for i, layer in enumerate(self.layers):
            ours, hf = f"layers.{i}.", f"model.layers.{i}."
            qkv = tuple(f"{hf}self_attn.{n}_proj" for n in self.qkv_sources())
            sources[ours + "self_attn.qkv_proj"] = qkv
            sources[ours + "self_attn.o_proj"] = (hf + "self_attn.o_proj",)
            if isinstance(layer.mlp, MLP):
                gate_up = tuple(f"{hf}mlp.{n}_proj" for n in self.gate_up_sources())
                sources[ours + "mlp.gate_up_proj"] = gate_up
                sources[ours + "mlp.down_proj"] = (hf + "mlp.down_proj",)
        return sources

    def qkv_sources(self) -> tuple[str, ...]:
        """The checkpoint's attention input projections (x in "self_attn.x_proj"), fused in this order."""
        return ("q", "k", "v")

    def gate_up_sources(self) -> tuple[str, ...]:
        return ("gate", "up")

    # ---- loading from Hugging Face tensor names -------------------------------------------------

    def tie_weights(self) -> None:
        """The LM head shares the embedding's weight where the checkpoint ties them; called again
        after moving the model off the meta device (``to_empty`` gives each its own tensor)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def expected_hf_tensors(self) -> dict[str, tuple[int, ...]]:
        """HF tensor name -> shape, for every tensor a checkpoint of this config must contain."""
        c = self.config
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        shapes: dict[str, tuple[int, ...]] = {
            "model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
            "model.norm.weight": (c.hidden_size,),
        }
        if not c.tie_word_embeddings:
            shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            shapes[p + "input_layernorm.weight"] = (c.hidden_size,)
            shapes[p + "post_attention_layernorm.weight"] = (c.hidden_size,)
            for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                shapes[f"{p}self_attn.{name}.weight"] = (rows, c.hidden_size)
                if c.qkv_bias:
                    shapes[f"{p}self_attn.{name}.bias"] = (rows,)
            shapes[p + "self_attn.o_proj.weight"] = (c.hidden_size, q)
            if c.o_bias:
                shapes[p + "self_attn.o_proj.bias"] = (c.hidden_size,)
            if c.qk_norm:
                shapes[p + "self_attn.q_norm.weight"] = (c.head_dim,)
                shapes[p + "self_attn.k_norm.weight"] = (c.head_dim,)
            for name, out_dim, in_dim in (
                ("gate_proj", c.intermediate_size, c.hidden_size),
                ("up_proj", c.intermediate_size, c.hidden_size),
                ("down_proj", c.hidden_size, c.intermediate_size),
            ):
                shapes[f"{p}mlp.{name}.weight"] = (out_dim, in_dim)
                if c.mlp_bias:
                    shapes[f"{p}mlp.{name}.bias"] = (out_dim,)
        return shapes

    @torch.no_grad()
    def load_hf_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy already-validated HF tensors (see ``expected_hf_tensors``) into the fused modules."""
        c = self.config
        self.embed_tokens.weight.copy_(tensors["model.embed_tokens.weight"])
        self.norm.weight.copy_(tensors["model.norm.weight"])
        if not c.tie_word_embeddings:
            self.lm_head.weight.copy_(tensors["lm_head.weight"])
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            layer.input_layernorm.weight.copy_(tensors[p + "input_layernorm.weight"])
            layer.post_attention_layernorm.weight.copy_(tensors[p + "post_attention_layernorm.weight"])
            qkv = [f"{p}self_attn.{n}_proj" for n in ("q", "k", "v")]
            attn.qkv_proj.weight.copy_(torch.cat([tensors[n + ".weight"] for n in qkv]))
            if c.qkv_bias:
                attn.qkv_proj.bias.copy_(torch.cat([tensors[n + ".bias"] for n in qkv]))
            attn.o_proj.weight.copy_(tensors[p + "self_attn.o_proj.weight"])
            if c.o_bias:
                attn.o_proj.bias.copy_(tensors[p + "self_attn.o_proj.bias"])
            if c.qk_norm:
                assert attn.q_norm is not None and attn.k_norm is not None
                attn.q_norm.weight.copy_(tensors[p + "self_attn.q_norm.weight"])
                attn.k_norm.weight.copy_(tensors[p + "self_attn.k_norm.weight"])
            if not isinstance(mlp, MLP):
                continue  # another family's MLP (a sparse MoE block) loads its own tensors
            gate_up = [f"{p}mlp.{n}_proj" for n in ("gate", "up")]
            mlp.gate_up_proj.weight.copy_(torch.cat([tensors[n + ".weight"] for n in gate_up]))
            mlp.down_proj.weight.copy_(tensors[p + "mlp.down_proj.weight"])
            if c.mlp_bias:
                mlp.gate_up_proj.bias.copy_(torch.cat([tensors[n + ".bias"] for n in gate_up]))
                mlp.down_proj.bias.copy_(tensors[p + "mlp.down_proj.bias"])
