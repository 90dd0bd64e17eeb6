"""Batch invariance where the native CPU kernels do not run (issue 45, item 3 and its CPU twin): on
CUDA with ``batch_invariant=True``, and on a CPU with the kernels off (``BULKINFER_CPU_KERNELS=0``,
as on an AVX2-only CPU or one without a compiler). The same property and schedules as
test_batch_invariance.py; there the fixed-shape PyTorch ops (engine/invariant/) carry it.

The CUDA cases need a GPU (benchmarks/gpu_check.sh runs them on a lent one): skipped without."""

from __future__ import annotations

import pytest
import torch

from bulkinfer.engine import cpu_kernels
from tests.engine.test_batch_invariance import check_rows_match_alone

# llama in both dtypes (bf16: where oneDNN's GEMMs change kernel with the row count) and a
# mixture-of-experts model (each expert's rows a different count every step).
CASES = [("llama", "float32"), ("llama", "bfloat16"), ("qwen3_moe", "bfloat16")]
EXAMPLES = {("llama", "bfloat16"): 3}  # drawn schedules besides EVERYTHING_AT_ONCE (~2 s each on CPU)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                  reason="needs a CUDA GPU"))]


@pytest.fixture
def kernels_off(monkeypatch: pytest.MonkeyPatch):
    """Engines built here run the PyTorch path: the native kernels are never loaded."""
    cpu_kernels.load.cache_clear()
    monkeypatch.setenv(cpu_kernels.DISABLE_ENV, "0")
    yield
    cpu_kernels.load.cache_clear()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch, dtype", CASES)
def test_on_the_pytorch_path_a_rows_output_is_what_it_gets_alone(checkpoint_factory, kernels_off,
                                                                  arch: str, dtype: str, device: str) -> None:
    model, examples = str(checkpoint_factory(arch=arch)), EXAMPLES.get((arch, dtype), 1)
    check_rows_match_alone(model, dtype, examples, device=device, batch_invariant=True)
