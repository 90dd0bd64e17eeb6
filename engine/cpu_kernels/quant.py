"""quant_gemm.c from Python: the checks before raw pointers, and torch tensors in and out."""

from __future__ import annotations

import ctypes
from typing import Any

import torch

_P = ctypes.c_void_p
_I = ctypes.c_int64
_F = ctypes.c_float

# quantize_rows_u8's modes
SYMMETRIC_PER_ROW, ASYMMETRIC_PER_ROW, STATIC = 0, 1, 2


def _declare(function: Any, arguments: list[Any]) -> Any:
    function.argtypes = [*arguments, ctypes.c_int]  # the thread count last, as every kernel
    function.restype = None
    return function


def _check(condition: bool, what: str) -> None:
    if not condition:
        raise ValueError(f"{what}: unsupported or inconsistent inputs")


class QuantKernels:
    def __init__(self, library: ctypes.CDLL, owner: Any) -> None:
        self.vector_lanes: int = owner.vector_lanes
        self._scratch_buffer = owner._scratch_buffer
        self._quantize = _declare(library.quantize_rows_u8, [_P, _I, _I, _I, _F, _I, _P, _P, _P])
        self._quantize_bf16 = _declare(library.quantize_rows_u8_bf16, [_P, _I, _I, _I, _F, _I, _P, _P, _P])
        self._int8_gemm = _declare(library.int8_gemm, [_P, _I, _I, _P, _I, _P, _P])
        self._epilogue = _declare(library.int8_epilogue, [_P, _I, _I, _P, _P, _P, _P, _P, _P])
        self._wq_gemm = _declare(library.wq_gemm, [_P, _I, _I, _P, _I, _I, _I, _I, _P, _P, _P, _P])
        self._wq_dequantize = _declare(library.wq_dequantize, [_P, _I, _I, _I, _I, _I, _P, _P, _P, _I])
        library.wq_bf16_applies.restype = _I
        library.wq_bf16_applies.argtypes = [_I, _I]
        self._wq_bf16_applies = library.wq_bf16_applies
        self._wq_gemm_bf16 = _declare(library.wq_gemm_bf16, [_P, _I, _I, _P, _I, _I, _I, _P, _P, _P, _P]) \
            if library.wq_bf16_applies(4, 32) else None
        library.int8_weight_panel.restype = _I
        library.int8_weight_panel.argtypes = []
        # int8_gemm's weight layout: outputs per panel (AVX512-VNNI builds, pack_int8), or 0: plain rows
        self.int8_panel: int = int(library.int8_weight_panel())
        # the fused GEMM and epilogue exists in VNNI builds only
        fused_arguments = [_P, _I, _I, _P, _I, _P, _P, _P, _P, _P, _P, _I, _P]
        self._int8_gemm_epilogue = _declare(library.int8_gemm_epilogue, fused_arguments) \
            if self.int8_panel else None

    def quantize_rows(self, x: torch.Tensor, mode: int, scale: float = 1.0,
                      zero_point: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """fp32 or bf16 ``x [rows, cols]`` as uint8, with each row's scale (fp32) and zero point (int32)
        (bf16 rows quantize as their exact fp32 values do)."""
        _check(x.dtype in (torch.float32, torch.bfloat16) and x.dim() == 2 and x.is_contiguous(),
               "quantize_rows")
        rows, cols = x.shape
        out = torch.empty(rows, cols, dtype=torch.uint8)
        scales = torch.empty(rows, dtype=torch.float32)
        zero_points = torch.empty(rows, dtype=torch.int32)
        quantize = self._quantize_bf16 if x.dtype == torch.bfloat16 else self._quantize
        quantize(x.data_ptr(), rows, cols, mode, scale, zero_point, out.data_ptr(), scales.data_ptr(),
                 zero_points.data_ptr(), torch.get_num_threads())
        return out, scales, zero_points

    def pack_int8(self, values: torch.Tensor) -> torch.Tensor:
        """int8 weights ``[n, k]`` in int8_gemm's layout: as they are, or (AVX512-VNNI) in panels of
        ``int8_panel`` outputs, panel[p][kq][o] the four inputs 4 kq.. of output panel * p + o as one
        int32 word (zeros past n and k)."""
        if not self.int8_panel:
            return values.contiguous()
        n, k = values.shape
        width, kq = self.int8_panel, -(-k // 4)
        padded = torch.zeros(-(-n // width) * width, kq * 4, dtype=torch.int8)
        padded[:n, :k] = values
        words = padded.view(-1, width, kq, 4).permute(0, 2, 1, 3).contiguous()
        return words.view(torch.int32).reshape(-1)

    def _check_int8(self, x: torch.Tensor, packed: torch.Tensor, n: int) -> None:
        rows, k = x.shape
        panel = self.int8_panel
        if panel:
            layout = packed.dtype == torch.int32 and packed.numel() == -(-n // panel) * panel * -(-k // 4)
        else:
            layout = packed.dtype == torch.int8 and packed.shape == (n, k)
        _check(x.dtype == torch.uint8 and x.dim() == 2 and x.is_contiguous() and packed.is_contiguous()
               and layout and k < 65536, "int8_gemm")

    def _x_scratch(self, rows: int, k: int) -> torch.Tensor:
        """int8_gemm's scratch: its rows widened to int16, or padded to whole words of four inputs."""
        return self._scratch_buffer("int8_gemm_x16", rows * max(k, 4 * -(-k // 4)), torch.int16)

    def int8_gemm(self, x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
        """``x (uint8 [rows, k])`` times the ``n`` outputs' int8 weights (``pack_int8``): the exact
        integer sums, as fp32 ``[rows, n]``."""
        self._check_int8(x, packed, n)
        rows, k = x.shape
        raw = torch.empty(rows, n, dtype=torch.float32)
        self._int8_gemm(x.data_ptr(), rows, k, packed.data_ptr(), n, raw.data_ptr(),
                        self._x_scratch(rows, k).data_ptr(), torch.get_num_threads())
        return raw

    def int8_gemm_epilogue(self, x: torch.Tensor, packed: torch.Tensor, n: int, row_scales: torch.Tensor,
                           row_zero_points: torch.Tensor, col_scales: torch.Tensor, col_sums: torch.Tensor,
                           bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """``int8_epilogue(int8_gemm(x, packed, n), ...)`` in one pass (AVX512-VNNI panels only), its
        output in ``dtype`` (fp32, or bf16 rounded as ``.to(torch.bfloat16)`` rounds)."""
        assert self._int8_gemm_epilogue is not None, "int8_gemm_epilogue needs the VNNI panels"
        self._check_int8(x, packed, n)
        rows, k = x.shape
        _check(dtype in (torch.float32, torch.bfloat16) and row_scales.shape == (rows,)
               and row_zero_points.shape == (rows,) and row_zero_points.dtype == torch.int32
               and col_scales.shape == (n,) and col_scales.dtype == torch.float32
               and col_sums.shape == (n,) and col_sums.dtype == torch.int32
               and (bias is None or (bias.shape == (n,) and bias.dtype == torch.float32)),
               "int8_gemm_epilogue")
        out = torch.empty(rows, n, dtype=dtype)
        row_scales, row_zero_points = row_scales.contiguous(), row_zero_points.contiguous()
        self._int8_gemm_epilogue(x.data_ptr(), rows, k, packed.data_ptr(), n, row_scales.data_ptr(),
                                 row_zero_points.data_ptr(), col_scales.data_ptr(), col_sums.data_ptr(),
                                 bias.data_ptr() if bias is not None else None, out.data_ptr(),
                                 int(dtype == torch.bfloat16), self._x_scratch(rows, k).data_ptr(),
                                 torch.get_num_threads())
        return out

    def int8_epilogue(self, raw: torch.Tensor, row_scales: torch.Tensor, row_zero_points: torch.Tensor,
                      col_scales: torch.Tensor, col_sums: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
        """``(raw - zp[m] * col_sum[n]) * scale[m] * col_scale[n] + bias[n]`` in fp32."""
        rows, n = raw.shape
        _check(raw.dtype == torch.float32 and raw.is_contiguous() and row_scales.shape == (rows,)
               and row_zero_points.shape == (rows,) and row_zero_points.dtype == torch.int32
               and col_scales.shape == (n,) and col_scales.dtype == torch.float32
               and col_sums.shape == (n,) and col_sums.dtype == torch.int32
               and (bias is None or (bias.shape == (n,) and bias.dtype == torch.float32)), "int8_epilogue")
        out = torch.empty_like(raw)
        self._epilogue(raw.data_ptr(), rows, n, row_scales.contiguous().data_ptr(),
                       row_zero_points.contiguous().data_ptr(), col_scales.data_ptr(), col_sums.data_ptr(),
                       bias.data_ptr() if bias is not None else None, out.data_ptr(), torch.get_num_threads())
        return out

    def weight_only_gemm(self, x: torch.Tensor, packed: torch.Tensor, bits: int, k: int, group: int,
                         scales: torch.Tensor, zeros: torch.Tensor | None,
                         bias: torch.Tensor | None) -> torch.Tensor:
        """fp32 ``x [rows, k]`` times the packed weights (``pack_weights``), fp32 ``[rows, n]``."""
        n = packed.shape[0]
        self._check_packed(packed, bits, k, group, scales, zeros)
        _check(x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] == k and x.is_contiguous()
               and (bias is None or (bias.shape == (n,) and bias.dtype == torch.float32)), "weight_only_gemm")
        out = torch.empty(x.shape[0], n, dtype=torch.float32)
        self._wq_gemm(x.data_ptr(), x.shape[0], k, packed.data_ptr(), packed.shape[1], bits, n, group,
                      scales.data_ptr(), zeros.data_ptr() if zeros is not None else None,
                      bias.data_ptr() if bias is not None else None, out.data_ptr(),
                      torch.get_num_threads())
        return out

    def weight_only_bf16_applies(self, bits: int, group: int) -> bool:
        """Whether bf16 rows take ``weight_only_gemm_bf16`` (4-bit weights, groups of whole 32-input
        blocks, a CPU with AVX512-BF16); decode_layers.c chooses by the same rule."""
        return bool(self._wq_bf16_applies(bits, group))

    def weight_only_gemm_bf16(self, x: torch.Tensor, packed: torch.Tensor, k: int, group: int,
                              scales: torch.Tensor, zeros: torch.Tensor | None,
                              bias: torch.Tensor | None) -> torch.Tensor:
        """bf16 ``x [rows, k]`` times the packed 4-bit weights, each group's bf16 products summed in
        fp32 and scaled once: bf16 ``[rows, n]``."""
        n = packed.shape[0]
        self._check_packed(packed, 4, k, group, scales, zeros)
        _check(self.weight_only_bf16_applies(4, group) and x.dtype == torch.bfloat16 and x.dim() == 2
               and x.shape[1] == k and x.is_contiguous()
               and (bias is None or (bias.shape == (n,) and bias.dtype == torch.float32)),
               "weight_only_gemm_bf16")
        out = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
        assert self._wq_gemm_bf16 is not None
        self._wq_gemm_bf16(x.data_ptr(), x.shape[0], k, packed.data_ptr(), packed.shape[1], n, group,
                           scales.data_ptr(), zeros.data_ptr() if zeros is not None else None,
                           bias.data_ptr() if bias is not None else None, out.data_ptr(),
                           torch.get_num_threads())
        return out

    def dequantize(self, packed: torch.Tensor, bits: int, k: int, group: int, scales: torch.Tensor,
                   zeros: torch.Tensor | None, out: torch.Tensor | None = None,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weights ``[n, k]`` of packed ones, in fp32 or rounded to bf16 (``dtype``: the bits of
        the fp32 ones ``.to(torch.bfloat16)``); ``out``: where to write them."""
        n = packed.shape[0]
        self._check_packed(packed, bits, k, group, scales, zeros)
        _check(dtype in (torch.float32, torch.bfloat16), "dequantize")
        if out is None:  # kept between calls: a fresh one would fault in its pages every call
            out = self._scratch_buffer(f"wq_dequantized_{dtype}", n * k, dtype)[:n * k].view(n, k)
        _check(out.shape == (n, k) and out.dtype == dtype and out.is_contiguous(), "dequantize")
        self._wq_dequantize(packed.data_ptr(), packed.shape[1], bits, n, k, group, scales.data_ptr(),
                            zeros.data_ptr() if zeros is not None else None, out.data_ptr(),
                            int(dtype == torch.bfloat16), torch.get_num_threads())
        return out

    def _check_packed(self, packed: torch.Tensor, bits: int, k: int, group: int, scales: torch.Tensor,
                      zeros: torch.Tensor | None) -> None:
        n, groups = packed.shape[0], -(-k // group)
        _check(packed.dtype == torch.uint8 and packed.dim() == 2 and packed.is_contiguous()
               and packed.shape[1] == packed_row_bytes(k, bits, self.vector_lanes)
               and scales.shape == (n, groups) and scales.dtype == torch.float32 and scales.is_contiguous()
               and (zeros is None or (zeros.shape == scales.shape and zeros.dtype == torch.float32
                                      and zeros.is_contiguous())), "packed weights")


def packed_row_bytes(k: int, bits: int, vector_lanes: int) -> int:
    """Bytes per weight row in quant_gemm.c's layout: k padded to blocks of 2 * lanes inputs."""
    block = 2 * vector_lanes
    padded = -(-k // block) * block
    return padded if bits == 8 else padded // 2


def pack_weights(values: torch.Tensor, bits: int, vector_lanes: int) -> torch.Tensor:
    """int8 values ``[n, k]`` (-8..7 for 4 bits) in quant_gemm.c's layout (uint8 ``[n, row bytes]``):
    8-bit as they are; 4-bit as + 8 in nibbles, each block of 2 * lanes inputs in lanes bytes, byte
    i holding input i (low nibble) and input lanes + i (high). Padding weights are zero."""
    n, k = values.shape
    block = 2 * vector_lanes
    padded = -(-k // block) * block
    wide = torch.zeros(n, padded, dtype=torch.int16)
    wide[:, :k] = values.to(torch.int16)
    if bits == 8:
        return wide.to(torch.int8).view(torch.uint8).contiguous()
    nibbles = (wide + 8).view(n, padded // block, 2, vector_lanes)
    packed = nibbles[:, :, 0, :] | (nibbles[:, :, 1, :] << 4)
    return packed.to(torch.uint8).reshape(n, padded // 2).contiguous()


def unpack_weights(packed: torch.Tensor, bits: int, k: int, vector_lanes: int) -> torch.Tensor:
    """``pack_weights`` undone: the int8 values ``[n, k]``."""
    n = packed.shape[0]
    if bits == 8:
        return packed.view(torch.int8)[:, :k].contiguous()
    blocks = packed.view(n, -1, vector_lanes).to(torch.int16)
    values = torch.stack([blocks & 15, blocks >> 4], dim=2) - 8  # [n, blocks, 2, lanes]
    return values.reshape(n, -1)[:, :k].to(torch.int8).contiguous()


def unpack_int8(packed: torch.Tensor, n: int, k: int, panel: int) -> torch.Tensor:
    """``QuantKernels.pack_int8`` (in panels of ``panel`` outputs; 0: plain rows) undone: the int8
    values ``[n, k]``."""
    if not panel:
        return packed
    kq = -(-k // 4)
    words = packed.view(torch.int8).view(-1, kq, panel, 4).permute(0, 2, 1, 3)
    return words.reshape(-1, kq * 4)[:n, :k].contiguous()
