"""A projection whose weights stay quantized in memory (next to ``Linear`` in engine/models/layers.py).

W8A8 int8: every row's activations are quantized to 8 bits (per token, or with the checkpoint's
static scale) and multiplied with the int8 weights in integers. The sums are exact, so any kernel
gives a row the same bits whatever its step holds. Where the native kernels have AVX512-VNNI the
weights are kept once, in its panels, and every row count takes them with the epilogue fused (out
in the model's dtype): 1.7-1.8x bf16's GEMM on a Zen 4 and faster than oneDNN's int8 there; with
AMX-INT8 oneDNN's tiles take prefill chunks too. Without VNNI, oneDNN's int8 GEMM adds pairs of
products in 16 bits, which overflow (measured on AVX2: sums off by 10^5), so the native kernel,
which widens to 32 bits first, computes every row there.

W8A16 / W4A16: decode rows through the native kernel, which reads the 8- or 4-bit weights and widens
them in registers (4-8x fewer bytes than fp32's); a prefill chunk's rows dequantize the weights once
into a scratch buffer and take the library GEMM (in fixed row blocks under batch invariance). Without
batch invariance a step of up to ``ROW_KERNEL_ROWS`` rows takes the row kernel whole. W4A16 on bf16
rows where the CPU has AVX512-BF16: every row through weight_only_gemm_bf16 (each weight the bf16 of
its dequantized value, looked up from the 4 bits inside the kernel; many rows read each block of
weights expanded once), decode and prefill alike; without batch invariance, steps of more than
``BF16_KERNEL_ROWS`` rows take the dequantized GEMM.

Without the native kernels (or off CPU) the same arithmetic runs in PyTorch: correct, not fast.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from bulkinfer.cpu_isa import active_cap, masked_flags, read_cpu_flags
from bulkinfer.engine.cpu_kernels.quant import (
    ASYMMETRIC_PER_ROW,
    STATIC,
    SYMMETRIC_PER_ROW,
    pack_weights,
    unpack_int8,
    unpack_weights,
)
from bulkinfer.engine.invariant.row_blocks import PREFILL_BLOCK_ROWS, in_row_blocks
from bulkinfer.engine.quant.checkpoint import QuantizedParts
from bulkinfer.quant_scheme import LayerScheme

if TYPE_CHECKING:
    from bulkinfer.engine.cpu_kernels import CpuKernels
    from bulkinfer.engine.models.step_rows import StepRows

ROW_KERNEL_ROWS = 16  # weight-only: more rows than this dequantize once and take the GEMM (measured)
# W4A16 on bf16 rows without batch invariance: more rows than this dequantize once and take the
# library's GEMM (on a Zen 4 the bf16 kernel is ahead up to ~64 rows, 1.2-1.35x behind at 256)
BF16_KERNEL_ROWS = 64
ONEDNN_INT8_ROWS = 8  # W8A8 with VNNI/AMX: from this many rows oneDNN's GEMM, below it the row kernel


@functools.cache
def onednn_int8_exact() -> bool:
    """Whether oneDNN's int8 GEMM sums without 16-bit overflow here (VNNI or AMX-INT8, under the
    project's ISA cap); AVX-VNNI alone is not counted (a cap at AVX2 leaves oneDNN on plain AVX2),
    nor is AVX512-VNNI under the `avx512` cap (oneDNN's AVX512_CORE has no VNNI)."""
    cap = active_cap()
    flags = masked_flags(read_cpu_flags(), cap)
    exact = {"amx_int8"} if cap == "avx512" else {"avx512_vnni", "amx_int8"}
    return bool(flags & exact) and hasattr(torch.ops.onednn, "qlinear_pointwise")


@functools.cache
def _amx_int8() -> bool:
    return "amx_int8" in masked_flags(read_cpu_flags(), active_cap())


def onednn_for_chunks(panel: int) -> bool:
    """Whether W8A8 prefill chunks take oneDNN's int8 GEMM: where it sums exactly, and the native
    kernels have no VNNI panels (``panel`` 0) or the CPU has AMX-INT8 (whose tiles outrun them)."""
    return onednn_int8_exact() and (not panel or _amx_int8())


class QuantizedLinear(nn.Module):
    """``y = x W^T + b`` with W stored as integers and scales (``QuantizedParts``)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, scheme: LayerScheme) -> None:
        super().__init__()
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        # The integer values, loaded by name as a float Linear's weight is (then packed by attach()).
        values = torch.empty(out_features, in_features, dtype=torch.int8)
        self.weight = nn.Parameter(values, requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.parts: QuantizedParts | None = None
        self.kernels: CpuKernels | None = None
        self.step_rows: StepRows | None = None
        self._packed: torch.Tensor | None = None  # quant_gemm.c's layout (W8A8: only in VNNI panels)
        self._packed_lanes = 0  # the vector lanes it was packed for (weight-only)
        self._packed_panel = 0  # W8A8: the outputs per panel it was packed in
        # Weight-only, set with the kernels: whether bf16 rows take weight_only_gemm_bf16
        self._bf16_row_kernel = False
        self._col_sums: torch.Tensor | None = None  # W8A8: each output's sum of weights (zero points)
        self._onednn_weight: torch.Tensor | None = None  # W8A8 with VNNI/AMX: oneDNN's packed int8 weight
        self._bias32: torch.Tensor | None = None  # the bias in fp32, as the kernels add it
        self._col_scales: torch.Tensor | None = None  # W8A8: each output's weight scale [out]
        self._unit_scales: tuple[torch.Tensor, torch.Tensor] | None = None  # W8A8 via oneDNN: ones, zeros

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme.name}"

    def attach(self, parts: QuantizedParts) -> None:
        """The layer's scales and zero points, after its integer weights are loaded (moved to the
        weights' device)."""
        device = self.weight.device
        parts.scales = parts.scales.to(device)
        if parts.zero_points is not None:
            parts.zero_points = parts.zero_points.to(device)
        self.parts = parts
        self._prepare()

    def use_kernels(self, kernels: CpuKernels | None, step_rows: StepRows | None) -> None:
        """Run through the native kernels (None: PyTorch); `step_rows`: the model's (batch invariance)."""
        self.kernels, self.step_rows = kernels, step_rows
        self._prepare()

    def _prepare(self) -> None:
        if self.parts is None:
            return
        self._bias32 = self.bias.detach().float().contiguous() if self.bias is not None else None
        if self.scheme.activations is not None:
            self._prepare_int8()
            return
        bits, kernels = self.scheme.weights.bits, self.kernels
        self._bf16_row_kernel = kernels is not None and kernels.quant.weight_only_bf16_applies(
            bits, self.parts.group_size)
        if kernels is not None and self.weight.device.type == "cpu":
            if self._packed is None:
                # The packed weights are the only copy: 4-bit ones take half the int8 values' memory.
                self._packed = pack_weights(self._integer_values(), bits, kernels.quant.vector_lanes)
                self._packed_lanes = kernels.quant.vector_lanes
                self.weight = nn.Parameter(torch.empty(0, dtype=torch.int8), requires_grad=False)
        elif self._packed is not None:  # back to PyTorch: the values again
            self.weight = nn.Parameter(self._integer_values(), requires_grad=False)
            self._packed = None

    def _prepare_int8(self) -> None:
        """W8A8: the weights' sums and scales; on a CPU whose kernels multiply in VNNI panels the
        panels are the only copy of the weights (every row count takes them, the epilogue fused),
        else the int8 rows, with oneDNN's packed copy for chunks where oneDNN sums them exactly."""
        assert self.parts is not None
        values = self._integer_values()
        self._col_sums = values.sum(dim=1, dtype=torch.int32).contiguous()
        self._col_scales = self.parts.scales[:, 0].contiguous()
        on_cpu, kernels = values.device.type == "cpu", self.kernels
        panel = kernels.quant.int8_panel if kernels is not None and on_cpu else 0
        if kernels is not None and panel and self._packed is None:
            self._packed, self._packed_panel = kernels.quant.pack_int8(values), panel
            self.weight = nn.Parameter(torch.empty(0, dtype=torch.int8), requires_grad=False)
        elif not panel and self._packed is not None:  # back to rows (the PyTorch path, or no VNNI)
            self.weight = nn.Parameter(values, requires_grad=False)
            self._packed, self._packed_panel = None, 0
        if not (on_cpu and onednn_for_chunks(panel)):
            self._onednn_weight = self._unit_scales = None
        elif self._onednn_weight is None:
            self._onednn_weight = torch.ops.onednn.qlinear_prepack(values.contiguous(), None)
            self._unit_scales = (torch.ones(self.out_features),
                                 torch.zeros(self.out_features, dtype=torch.int64))

    def _integer_values(self) -> torch.Tensor:
        """The int8 values ``[out, in]``, from wherever they are kept now."""
        if self._packed is None:
            return self.weight.detach()
        if self.scheme.activations is not None:
            return unpack_int8(self._packed, self.out_features, self.in_features, self._packed_panel)
        return unpack_weights(self._packed, self.scheme.weights.bits, self.in_features, self._packed_lanes)

    # ---- forward ------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.parts is not None, "QuantizedLinear used before attach()"
        flat = x.reshape(-1, self.in_features)
        if self.scheme.activations is not None:
            out = self._int8_rows(flat, x.dtype)
        else:
            out = self._weight_only_rows(flat)
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def _int8_rows(self, flat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        parts, kernels = self.parts, self.kernels
        assert parts is not None and self._col_sums is not None
        # bf16 rows are quantized as they are (the kernel widens each exactly), other dtypes from fp32
        x = (flat if flat.dtype == torch.bfloat16 else flat.float()).contiguous()
        mode, scale, zero = self._activation_quantization(x)
        col_scales = self._col_scales
        assert col_scales is not None
        if kernels is None or x.device.type != "cpu":
            return self._int8_in_torch(x.float(), mode, scale, zero, col_scales)
        quantized, row_scales, row_zeros = kernels.quant.quantize_rows(x, mode, scale, zero)
        onednn = self._onednn_weight is not None and x.shape[0] >= ONEDNN_INT8_ROWS
        if self._packed is not None and not onednn:
            # VNNI panels: the GEMM and the epilogue in one pass, out in the model's dtype
            out_dtype = dtype if dtype == torch.bfloat16 else torch.float32
            return kernels.quant.int8_gemm_epilogue(quantized, self._packed, self.out_features, row_scales,
                                                    row_zeros, col_scales, self._col_sums, self._bias32,
                                                    out_dtype)
        if onednn:
            # unit scales, no zero points: fp32 of the integer sums, as int8_gemm gives them
            assert self._unit_scales is not None
            ones, zeros = self._unit_scales
            raw = torch.ops.onednn.qlinear_pointwise(quantized, 1.0, 0, self._onednn_weight, ones, zeros,
                                                     None, 1.0, 0, torch.float32, "none", [None], "")
        else:
            weights = self._packed if self._packed is not None else self.weight.detach()
            raw = kernels.quant.int8_gemm(quantized, weights, self.out_features)
        return kernels.quant.int8_epilogue(raw, row_scales, row_zeros, col_scales, self._col_sums,
                                           self._bias32)

    def _fixed_activation_quantization(self) -> tuple[int, float, int] | None:
        """quantize_rows' mode, scale and uint8 zero point where they do not depend on the call's rows
        (per token, or the checkpoint's static scale); None for a scale per call."""
        parts = self.parts
        assert parts is not None and parts.scheme.activations is not None
        activations = parts.scheme.activations
        if not activations.dynamic:
            assert parts.input_scale is not None
            return STATIC, parts.input_scale, parts.input_zero_point + 128
        if activations.per_token:
            return (SYMMETRIC_PER_ROW if activations.symmetric else ASYMMETRIC_PER_ROW), 1.0, 0
        return None

    def _activation_quantization(self, x: torch.Tensor) -> tuple[int, float, int]:
        """quantize_rows' mode, and the scale and uint8 zero point of a per-tensor one."""
        fixed = self._fixed_activation_quantization()
        if fixed is not None:
            return fixed
        # dynamic per tensor: one scale over the call's rows
        assert self.scheme.activations is not None
        if self.scheme.activations.symmetric:
            absmax = float(x.abs().max()) if x.numel() else 0.0
            return STATIC, (absmax / 127.0 if absmax > 0 else 1.0), 128
        low, high = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
        scale = (high - low) / 255.0 if high > low else 1.0
        return STATIC, scale, int(min(max(round(-low / scale), 0), 255))

    def _int8_in_torch(self, x: torch.Tensor, mode: int, scale: float, zero: int,
                       col_scales: torch.Tensor) -> torch.Tensor:
        """The same quantization and integer sums in PyTorch (no native kernels, or not a CPU)."""
        if mode == SYMMETRIC_PER_ROW:
            absmax = x.abs().amax(dim=1, keepdim=True)
            scales = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))
            zeros = torch.full_like(scales, 128.0)
            low = 1.0
        elif mode == ASYMMETRIC_PER_ROW:
            low_v = x.amin(dim=1, keepdim=True).clamp(max=0)
            high_v = x.amax(dim=1, keepdim=True).clamp(min=0)
            scales = torch.where(high_v > low_v, (high_v - low_v) / 255.0, torch.ones_like(high_v))
            zeros = torch.round(-low_v / scales).clamp(0, 255)
            low = 0.0
        else:
            scales = torch.full((x.shape[0], 1), scale, device=x.device)
            zeros = torch.full_like(scales, float(zero))
            low = 0.0
        quantized = (torch.round(x / scales) + zeros).clamp(low, 255.0)
        weights = self.weight.detach().to(x.device).float() * col_scales.to(x.device)[:, None]
        out = ((quantized - zeros) * scales) @ weights.t()
        bias = self._bias32
        return out + bias.to(x.device) if bias is not None else out

    def _weight_only_rows(self, flat: torch.Tensor) -> torch.Tensor:
        """Single-token rows through the row kernel (all rows where there are few), the rest through
        the weights dequantized once and the library GEMM; under batch invariance always so split, the
        prefill rows in fixed blocks (as ``Linear`` does: a row's bits never follow its step)."""
        parts, kernels = self.parts, self.kernels
        assert parts is not None
        bias = self.bias.detach() if self.bias is not None else None
        if kernels is None or self._packed is None or flat.device.type != "cpu":
            return F.linear(flat, self._dequantized_in_torch().to(flat.device, flat.dtype), bias)
        rows = flat.shape[0]
        invariant = self.step_rows is not None and self.step_rows.every_row
        single = rows if self.step_rows is None else min(self.step_rows.single, rows)
        if self._rows_in_bf16(flat) and (invariant or rows <= BF16_KERNEL_ROWS):
            # every row alone in the same order (its bits never follow its step), decode and prefill
            return self._row_kernel(flat)  # already the model's dtype
        if not invariant and rows <= ROW_KERNEL_ROWS:
            single = rows
        elif not invariant:
            single = 0
        out = torch.empty(rows, self.out_features, dtype=torch.float32)
        if single:
            out[:single] = self._row_kernel(flat[:single])
        if single < rows:
            chunk = flat[single:]
            native = chunk.dtype in (torch.float32, torch.bfloat16)  # dequantized straight into its dtype
            weight = kernels.quant.dequantize(self._packed, self.scheme.weights.bits, self.in_features,
                                              parts.group_size, parts.scales, parts.zero_points,
                                              dtype=chunk.dtype if native else torch.float32)
            weight = weight if native else weight.to(chunk.dtype)

            def gemm(x: torch.Tensor) -> torch.Tensor:
                return F.linear(x, weight, bias)

            out[single:] = in_row_blocks(gemm, chunk, PREFILL_BLOCK_ROWS) if invariant else gemm(chunk)
        return out

    def _rows_in_bf16(self, rows: torch.Tensor) -> bool:
        """Whether the row kernel takes these rows in bf16 as they are (weight_only_gemm_bf16)."""
        return rows.dtype == torch.bfloat16 and self._bf16_row_kernel

    def _row_kernel(self, rows: torch.Tensor) -> torch.Tensor:
        """Single-token rows through the native kernel: bf16 rows through AVX512-BF16 where it runs
        (out in bf16, the kernel the native decode path takes too), else in fp32 (out in fp32)."""
        parts, kernels = self.parts, self.kernels
        assert parts is not None and kernels is not None and self._packed is not None
        if self._rows_in_bf16(rows):
            return kernels.quant.weight_only_gemm_bf16(rows.contiguous(), self._packed, self.in_features,
                                                       parts.group_size, parts.scales, parts.zero_points,
                                                       self._bias32)
        bits = self.scheme.weights.bits
        return kernels.quant.weight_only_gemm(rows.float().contiguous(), self._packed, bits, self.in_features,
                                              parts.group_size, parts.scales, parts.zero_points,
                                              self._bias32)

    def _dequantized_in_torch(self) -> torch.Tensor:
        parts = self.parts
        assert parts is not None
        columns = torch.arange(self.in_features, device=parts.scales.device) // parts.group_size
        values = self._integer_values().float()
        if parts.zero_points is not None:
            values = values - parts.zero_points[:, columns]
        return values * parts.scales[:, columns]

    # ---- the native decode path (engine/models/native_decode.py) --------------------------------

    def native_fields(self) -> dict[str, object] | None:
        """decode_layers.c's description of this projection (its ``decode_quant`` fields, pointers as
        ints into tensors this module keeps), or None where decode steps must keep the Python path:
        no native kernels, or activations quantized per call (one scale over the step's rows, which
        the Python path computes in PyTorch)."""
        parts = self.parts
        if parts is None or self.kernels is None or self.weight.device.type != "cpu":
            return None
        bias = self._bias32.data_ptr() if self._bias32 is not None else None
        if self.scheme.activations is None:
            if self._packed is None:
                return None
            zeros = parts.zero_points.data_ptr() if parts.zero_points is not None else None
            return dict(kind=2, weight=self._packed.data_ptr(), row_bytes=self._packed.shape[1],
                        bits=self.scheme.weights.bits, group=parts.group_size, scales=parts.scales.data_ptr(),
                        zeros=zeros, bias=bias)
        fixed = self._fixed_activation_quantization()
        if fixed is None:
            return None
        assert self._col_sums is not None and self._col_scales is not None
        mode, scale, zero = fixed
        weight = self._packed if self._packed is not None else self.weight
        return dict(kind=1, weight=weight.data_ptr(), scales=self._col_scales.data_ptr(),
                    col_sums=self._col_sums.data_ptr(), bias=bias, act_mode=mode, act_scale=scale,
                    act_zero=zero)

    def native_rows_match(self, rows: int, dtype: torch.dtype) -> bool:
        """Whether a decode step of `rows` rows in `dtype` takes the row kernel in the Python path too
        (so the native path gives its bits): always for W8A8 (exact integer sums on every path) and
        under batch invariance; else up to ROW_KERNEL_ROWS rows (BF16_KERNEL_ROWS for bf16 rows on the
        bf16 kernel; more take the dequantized GEMM)."""
        if self.scheme.activations is not None:
            return True
        most = BF16_KERNEL_ROWS if dtype == torch.bfloat16 and self._bf16_row_kernel else ROW_KERNEL_ROWS
        return (self.step_rows is not None and self.step_rows.every_row) or rows <= most

    def native_scratch(self) -> tuple[int, int]:
        """(inputs, outputs) a row of this projection needs in decode_layers.c's scratch."""
        return self.in_features, self.out_features
