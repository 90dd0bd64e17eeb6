"""The quantized projections' native kernels (engine/cpu_kernels/quant_gemm.c) against PyTorch, and
the checkpoint unpacking against compressed-tensors' own."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

from bulkinfer.engine import cpu_kernels
from bulkinfer.engine.cpu_kernels.quant import (
    ASYMMETRIC_PER_ROW,
    SYMMETRIC_PER_ROW,
    pack_weights,
    unpack_int8,
    unpack_weights,
)
from bulkinfer.engine.quant.checkpoint import unpack_int32


@pytest.fixture(scope="module")
def quant():
    kernels = cpu_kernels.load()
    assert kernels is not None, "the native kernels build on every CI machine"
    return kernels.quant


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dim", [0, 1])
def test_unpacking_matches_compressed_tensors(bits: int, dim: int) -> None:
    torch.manual_seed(bits)
    low, high = -(1 << (bits - 1)), 1 << (bits - 1)
    values = torch.randint(low, high, (37, 45), dtype=torch.int8)
    packed = pack_to_int32(values, bits, packed_dim=dim)
    length = values.shape[dim]
    ours = unpack_int32(packed, bits, length, dim=dim)
    assert torch.equal(ours, unpack_from_int32(packed, bits, values.shape, packed_dim=dim))
    assert torch.equal(ours, values)


@pytest.mark.parametrize("bits", [4, 8])
def test_packing_for_the_kernel_round_trips(quant, bits: int) -> None:
    values = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (9, 77), dtype=torch.int8)
    packed = pack_weights(values, bits, quant.vector_lanes)
    assert torch.equal(unpack_weights(packed, bits, 77, quant.vector_lanes), values)


@pytest.mark.parametrize("bits, group, k, symmetric", [
    (4, 32, 256, True), (4, 64, 256, False), (8, 256, 256, True),  # whole vector blocks per group
    (4, 24, 120, False), (8, 120, 120, False),  # groups off the blocks: the scalar path
])
@pytest.mark.parametrize("rows", [1, 3, 6])
def test_weight_only_rows_and_dequantization_match_pytorch(quant, bits, group, k, symmetric, rows) -> None:
    torch.manual_seed(rows * k + bits)
    n, groups = 40, -(-k // group)
    values = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (n, k), dtype=torch.int8)
    scales = torch.rand(n, groups) * 0.02 + 0.001
    zeros = None if symmetric else torch.randint(-3, 4, (n, groups)).float()
    columns = torch.arange(k) // group
    reference = values.float() - (zeros[:, columns] if zeros is not None else 0.0)
    reference = reference * scales[:, columns]
    packed = pack_weights(values, bits, quant.vector_lanes)
    assert torch.equal(quant.dequantize(packed, bits, k, group, scales, zeros), reference)
    x, bias = torch.randn(rows, k), torch.randn(n)
    out = quant.weight_only_gemm(x, packed, bits, k, group, scales, zeros, bias)
    torch.testing.assert_close(out, x @ reference.t() + bias, rtol=1e-5, atol=1e-5)
    alone = torch.cat([quant.weight_only_gemm(x[i:i + 1].contiguous(), packed, bits, k, group, scales, zeros,
                                              bias) for i in range(rows)])
    assert torch.equal(out, alone)  # each row's sums in the same order whatever the others are


def test_int8_sums_are_exact_over_the_whole_range(quant) -> None:
    """uint8 255 times int8 -128 in every pair: where oneDNN's AVX2 kernel overflows 16-bit sums."""
    x = torch.full((3, 1000), 255, dtype=torch.uint8)
    x[1] = torch.randint(0, 256, (1000,), dtype=torch.uint8)
    w = torch.full((5, 1000), -128, dtype=torch.int8)
    w[2] = torch.randint(-128, 128, (1000,), dtype=torch.int8)
    raw = quant.int8_gemm(x, quant.pack_int8(w), 5)
    assert torch.equal(raw, (x.long() @ w.long().t()).float())


@pytest.mark.parametrize(("rows", "k", "n"), [(16, 1000, 5), (23, 33, 37), (70, 576, 48)])
def test_many_rows_take_the_packed_kernel_and_its_sums_are_as_exact(quant, rows: int, k: int, n: int) -> None:
    """From 16 rows the weights are widened into panels and each row's pairs broadcast against them
    (odd k, outputs past a panel, rows past a tile): the same exact sums, extremes included."""
    torch.manual_seed(rows)
    x = torch.randint(0, 256, (rows, k), dtype=torch.uint8)
    x[0] = 255
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    w[1] = -128
    packed = quant.pack_int8(w)
    assert torch.equal(unpack_int8(packed, n, k, quant.int8_panel), w)
    raw = quant.int8_gemm(x, packed, n)
    assert torch.equal(raw, (x.long() @ w.long().t()).float())
    assert torch.equal(raw[:3], quant.int8_gemm(x[:3], packed, n))  # the few-row kernel: the same bits


@pytest.mark.parametrize(("rows", "k", "n"), [(1, 576, 960), (7, 33, 37), (70, 576, 48)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_epilogue_gives_the_bits_of_the_sums_then_the_epilogue(quant, rows: int, k: int, n: int,
                                                                        dtype: torch.dtype) -> None:
    """VNNI panels: the GEMM and the epilogue in one pass (nothing in memory between them), in fp32 or
    rounded to bf16 as torch rounds: the bits of int8_gemm, int8_epilogue and .to(dtype)."""
    if not quant.int8_panel:
        pytest.skip("the fused epilogue runs on the VNNI panels (an AVX512-VNNI CPU)")
    torch.manual_seed(k)
    x = torch.randint(0, 256, (rows, k), dtype=torch.uint8)
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    packed = quant.pack_int8(w)
    row_scales, row_zeros = torch.rand(rows) / 50, torch.randint(0, 256, (rows,), dtype=torch.int32)
    col_scales, col_sums, bias = torch.rand(n) / 50, w.sum(1, dtype=torch.int32), torch.randn(n)
    separate = quant.int8_epilogue(quant.int8_gemm(x, packed, n), row_scales, row_zeros, col_scales, col_sums,
                                   bias)
    fused = quant.int8_gemm_epilogue(x, packed, n, row_scales, row_zeros, col_scales, col_sums, bias, dtype)
    assert fused.dtype == dtype and torch.equal(fused, separate.to(dtype))


@pytest.mark.parametrize("mode", [SYMMETRIC_PER_ROW, ASYMMETRIC_PER_ROW])
def test_rows_quantize_as_compressed_tensors_defines_it(quant, mode: int) -> None:
    torch.manual_seed(mode)
    x = torch.randn(4, 300) * torch.tensor([[1.0], [0.01], [30.0], [0.0]]) + (0.5 if mode else 0.0)
    q, scales, zeros = quant.quantize_rows(x, mode)
    if mode == SYMMETRIC_PER_ROW:
        absmax = x.abs().amax(1)
        expected_scales = torch.where(absmax > 0, absmax / 127, torch.ones_like(absmax))
        assert torch.equal(zeros, torch.full((4,), 128, dtype=torch.int32))
        assert int(q.min()) >= 1  # -127..127: symmetric int8 never takes -128
    else:
        low, high = x.amin(1).clamp(max=0), x.amax(1).clamp(min=0)
        expected_scales = torch.where(high > low, (high - low) / 255, torch.ones_like(high))
    torch.testing.assert_close(scales, expected_scales)
    expected = (torch.round(x / scales[:, None]) + zeros[:, None]).clamp(0, 255)
    assert torch.equal(q.long(), expected.long())
    dequantized = (q.float() - zeros[:, None]) * scales[:, None]
    assert bool(((dequantized - x).abs() <= scales[:, None] / 2 + 1e-6).all())  # half a step at most
    # A bf16 model's rows are quantized as they are: the bits of their exact fp32 values'.
    rows_bf16 = x.to(torch.bfloat16)
    for got, want in zip(quant.quantize_rows(rows_bf16, mode), quant.quantize_rows(rows_bf16.float(), mode),
                         strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize(("rows", "k", "n", "group", "asymmetric"),
                         [(1, 576, 96, 64, False), (3, 128, 37, 32, True), (9, 160, 21, 32, True),
                          (6, 256, 19, 128, True), (5, 192, 10, 32, False)])
def test_bf16_rows_of_4bit_weights_sum_each_group_then_scale_it(quant, rows: int, k: int, n: int, group: int,
                                                               asymmetric: bool) -> None:
    """W4A16 on bf16 rows (AVX512-BF16): what a bf16 model of the dequantized checkpoint computes
    (each weight bf16((q - zero) * scale), the products summed in fp32) to within the output's bf16
    rounding, and each row's bits whatever rows come with it."""
    if not quant.weight_only_bf16_applies(4, group):
        pytest.skip("the bf16 kernel runs on CPUs with AVX512-BF16")
    torch.manual_seed(k)
    values = torch.randint(-8, 8, (n, k), dtype=torch.int8)
    packed = pack_weights(values, 4, quant.vector_lanes)
    scales = torch.rand(n, k // group) / 10 + 1e-3
    zeros = torch.randint(-3, 4, (n, k // group)).float() if asymmetric else None
    x, bias = torch.randn(rows, k).to(torch.bfloat16), torch.randn(n)
    out = quant.weight_only_gemm_bf16(x, packed, k, group, scales, zeros, bias)
    weights = quant.dequantize(packed, 4, k, group, scales, zeros, dtype=torch.bfloat16)
    reference = x.double() @ weights.double().t() + bias.double()
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), reference, rtol=2 ** -8, atol=1e-4)
    # Alone (the lone-row tile), in twos (the few-rows tile) and all at once (from 4 rows the weights
    # expanded first): the same bits.
    for size in (1, 2):
        parts = [quant.weight_only_gemm_bf16(x[i:i + size].contiguous(), packed, k, group, scales, zeros,
                                             bias) for i in range(0, rows, size)]
        assert torch.equal(out, torch.cat(parts))
