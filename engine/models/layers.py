"""The Llama family's building blocks: RMSNorm, rotary embedding, the projections (``Linear``, with
its CPU kernels) and the SiLU MLP. The decoder (engine/models/llama.py), the sparse MoE block and the
native decode path (engine/models/native_decode.py) all build on them, so they live apart from the
model that assembles them."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from bulkinfer.engine.invariant import LOGIT_BLOCK_ROWS, in_row_blocks, in_step_row_blocks
from bulkinfer.engine.models.llama_config import LlamaFamilyConfig, rope_inverse_frequencies
from bulkinfer.engine.models.step_rows import StepRows

if TYPE_CHECKING:
    from bulkinfer.engine.cpu_kernels import CpuKernels
    from bulkinfer.engine.gpu_kernels.layer_ops import TritonLayerOps
    from bulkinfer.engine.lora.slots import LoRASlots


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


class Embedding(nn.Embedding):
    """nn.Embedding that skips its random init on the meta device, where the loaders build every
    model before filling it from the checkpoint: there the init sets no value, yet it is a
    process's first ``normal_`` on meta, for which torch imports torch._dynamo (1-2 s of an engine's
    or a tensor-parallel rank's start on 2 cores). Elsewhere nn.Embedding's own init."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


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
