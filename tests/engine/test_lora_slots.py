"""The per-row update of one projection: each row gets its own adapter's (x @ A.T) @ B.T, base rows
nothing, whichever way the step's rows fall (runs of one length and consecutive slots take the
batched path, others one run at a time)."""

from __future__ import annotations

import pytest
import torch

from bulkinfer.engine.lora.rows import NO_ADAPTER, LoRARows
from bulkinfer.engine.lora.slots import LoRASlots
from bulkinfer.engine.models.step_rows import StepRows

IN, OUT, MAX_LORAS, MAX_WIDTH = 24, 40, 4, 12


def loaded_slots(widths: list[int]) -> tuple[LoRASlots, list[tuple[torch.Tensor, torch.Tensor]]]:
    slots = LoRASlots(MAX_LORAS, MAX_WIDTH, IN, OUT, torch.float64, torch.device("cpu"), step_rows=None)
    generator = torch.Generator().manual_seed(0)
    for slot in range(MAX_LORAS):  # a wide adapter first, so a narrower one must clear its tail
        slots.load(slot, (torch.randn(MAX_WIDTH, IN, generator=generator, dtype=torch.float64),
                          torch.randn(OUT, MAX_WIDTH, generator=generator, dtype=torch.float64)))
    weights = []
    for slot, width in enumerate(widths):
        pair = (torch.randn(width, IN, generator=generator, dtype=torch.float64),
                torch.randn(OUT, width, generator=generator, dtype=torch.float64))
        slots.load(slot, pair)
        weights.append(pair)
    return slots, weights


@pytest.mark.parametrize(("row_slots", "batched"), [
    ([0, 0, 1, 1, 2, 2, 3, 3], True),  # an even mix: two batched matmuls
    ([NO_ADAPTER, NO_ADAPTER, 1, 1, 1, 2, 2, 2], True),  # base rows first, then the mix
    ([0, 0, 0, 1, 2, 2, 3, 3], False),  # runs of different lengths
    ([0, 0, 2, 2, NO_ADAPTER, 3, 3, 1], False),  # slots not consecutive, a base row between runs
])
def test_each_row_gets_its_own_adapters_update(row_slots, batched):
    slots, weights = loaded_slots([12, 4, 8, 6])
    x = torch.randn(len(row_slots), IN, dtype=torch.float64)
    base = torch.randn(len(row_slots), OUT, dtype=torch.float64)
    rows = LoRARows(torch.tensor(row_slots))
    assert (rows.batched() is not None) == batched
    result = slots.add_updates(x, base.clone(), rows)
    for i, slot in enumerate(row_slots):
        if slot == NO_ADAPTER:
            torch.testing.assert_close(result[i], base[i])
        else:
            a, b = weights[slot]
            torch.testing.assert_close(result[i], base[i] + (x[i] @ a.T) @ b.T)


def test_an_adapter_that_leaves_the_projection_alone_adds_nothing():
    slots, _ = loaded_slots([12, 4, 8, 6])
    slots.load(1, None)
    x, base = torch.randn(4, IN, dtype=torch.float64), torch.randn(4, OUT, dtype=torch.float64)
    result = slots.add_updates(x, base.clone(), LoRARows(torch.tensor([1, 1, 1, 1])))
    torch.testing.assert_close(result, base)


def native_kernels():
    from bulkinfer.engine import cpu_kernels

    kernels = cpu_kernels.load()
    assert kernels is not None, "the CPU kernels are built on every test machine"
    return kernels


def kernel_slots(dtype: torch.dtype, in_features: int, out_features: int, widths: list[int],
                 step_rows: StepRows | None = None
                 ) -> tuple[LoRASlots, list[tuple[torch.Tensor, torch.Tensor]]]:
    slots = LoRASlots(len(widths), max(widths), in_features, out_features, dtype, torch.device("cpu"),
                      step_rows=step_rows)
    kernels = native_kernels()
    slots.use_kernels(kernels)
    # The row kernel takes fp32 with AVX-512 and bf16 with AMX or AVX512-BF16; elsewhere the
    # PyTorch matmuls apply every update (and these tests check those).
    assert (slots.kernels is not None) == (dtype in kernels.row_gemm_dtypes)
    generator = torch.Generator().manual_seed(1)
    weights = []
    for slot, width in enumerate(widths):
        pair = (torch.randn(width, in_features, generator=generator).to(dtype),
                torch.randn(out_features, width, generator=generator).to(dtype) * 0.1)
        slots.load(slot, pair)
        weights.append(pair)
    return slots, weights


# Output widths that are and are not whole panels of the row kernel; an input width that is not whole
# 32-wide tiles (fp32 only: bf16 needs them).
@pytest.mark.parametrize(("dtype", "in_features", "out_features"), [
    (torch.float32, 64, 96), (torch.float32, 40, 70), (torch.bfloat16, 64, 96), (torch.bfloat16, 96, 70)])
def test_the_native_kernel_adds_each_rows_update(in_features, out_features, dtype):
    slots, weights = kernel_slots(dtype, in_features, out_features, [16, 8, 5])
    row_slots = [NO_ADAPTER, 0, 0, 0, 0, 0, 1, 2, 2, NO_ADAPTER, 1]  # runs longer than a tile of 4
    x = torch.randn(len(row_slots), in_features).to(dtype)
    base = torch.randn(len(row_slots), out_features).to(dtype)
    result = slots.add_updates(x, base.clone(), LoRARows(torch.tensor(row_slots)))
    # fp32: only the summation order differs from float64's; bf16: the result's rounding
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    for i, slot in enumerate(row_slots):
        expected = base[i].double()
        if slot != NO_ADAPTER:
            a, b = (w.double() for w in weights[slot])
            shrunk = x[i].double() @ a.T
            if dtype == torch.bfloat16:  # the row kernel, and a bf16 matmul, round the rank-sized product
                shrunk = shrunk.to(dtype).double()
            expected = expected + shrunk @ b.T
        if slot == NO_ADAPTER:
            assert torch.equal(result[i], base[i])  # base rows untouched
        else:
            torch.testing.assert_close(result[i].double(), expected, **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_update_under_batch_invariance_does_not_depend_on_the_other_rows(dtype):
    """Batch invariance: the same row alone, at another place among other rows, or in a run of one
    adapter of another length, gets the same bits; from the row kernel where this CPU has it for the
    dtype, else from fixed row blocks (engine/invariant: an AVX2-only CPU, bf16 without AMX or
    AVX512-BF16)."""
    slots, _ = kernel_slots(dtype, 96, 160, [16, 12], StepRows(every_row=True))
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(9, 96, generator=generator).to(dtype)
    base = torch.randn(9, 160, generator=generator).to(dtype)
    mixed = slots.add_updates(x, base.clone(), LoRARows(torch.tensor([0, 0, 0, 1, 1, 0, 0, 0, 0])))
    for row, slot in ((0, 0), (3, 1), (8, 0)):
        alone = slots.add_updates(x[row : row + 1], base[row : row + 1].clone(),
                                  LoRARows(torch.tensor([slot])))
        assert torch.equal(alone[0], mixed[row])
