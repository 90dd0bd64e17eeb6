"""W8A8's oneDNN path (prefill chunks on CPUs with VNNI or AMX-INT8) on every CPU.

oneDNN's AVX2 int8 kernel adds pairs of uint8 x int8 products in 16 bits; with weights in [-63, 63]
a pair stays below 2 * 255 * 63 = 32,130 < 32,767, so its sums are exact here too and the path's
plumbing (prepacking, unit scales, the shared epilogue) is checked wherever CI runs, bit for bit
against the native kernel (VNNI panels with the fused epilogue, or the int8 rows)."""

from __future__ import annotations

import pytest
import torch

from bulkinfer.engine import cpu_kernels
from bulkinfer.engine.quant import linear as quant_linear
from bulkinfer.engine.quant.checkpoint import QuantizedParts
from bulkinfer.engine.quant.linear import ONEDNN_INT8_ROWS, QuantizedLinear
from bulkinfer.quant_scheme import ActivationQuant, LayerScheme, WeightQuant

ACTIVATIONS = {
    "dynamic per token, symmetric": ActivationQuant(dynamic=True, per_token=True, symmetric=True),
    "dynamic per token, asymmetric": ActivationQuant(dynamic=True, per_token=True, symmetric=False),
    "static, asymmetric": ActivationQuant(dynamic=False, per_token=False, symmetric=False),
}


def w8a8_projection(activations: ActivationQuant, onednn: bool) -> QuantizedLinear:
    kernels = cpu_kernels.load()
    assert kernels is not None, "the native kernels build on every CI machine"
    scheme = LayerScheme(WeightQuant(bits=8, group_size=None, symmetric=True), activations, "int-quantized")
    torch.manual_seed(1)
    projection = QuantizedLinear(192, 96, bias=True, scheme=scheme)
    projection.weight.data = torch.randint(-63, 64, (96, 192), dtype=torch.int8)
    projection.bias.data = torch.randn(96)
    parts = QuantizedParts(scheme, torch.rand(96, 1) * 0.01 + 1e-3, None, 192)
    if not activations.dynamic:
        parts.input_scale, parts.input_zero_point = 0.02, -5
    # Installed the way the loader installs it: the oneDNN weight is prepacked at attach() time.
    original = quant_linear.onednn_for_chunks
    quant_linear.onednn_for_chunks = lambda panel: onednn
    try:
        projection.attach(parts)
        projection.use_kernels(kernels, None)
    finally:
        quant_linear.onednn_for_chunks = original
    assert (projection._onednn_weight is not None) == onednn
    return projection


@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_onednn_prefill_rows_equal_the_row_kernel_bit_for_bit(name: str) -> None:
    activations = ACTIVATIONS[name]
    through_onednn = w8a8_projection(activations, onednn=True)
    native_only = w8a8_projection(activations, onednn=False)
    rows = torch.randn(64, 192) * 3
    assert rows.shape[0] >= ONEDNN_INT8_ROWS
    with torch.inference_mode():
        batched = through_onednn(rows)
        alone = torch.cat([through_onednn(rows[i:i + 1]) for i in range(rows.shape[0])])
        native = native_only(rows)
        native_only.use_kernels(None, None)
        in_torch = native_only(rows)
    assert torch.equal(batched, native)  # the same integer sums and the same epilogue
    assert torch.equal(batched, alone)  # a row's bits do not follow whether oneDNN took its step
    assert torch.allclose(batched, in_torch, rtol=1e-4, atol=1e-4)
