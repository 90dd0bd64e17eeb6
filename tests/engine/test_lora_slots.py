"""The per-row update of one projection: each row gets its own adapter's (x @ A.T) @ B.T, base rows
nothing, whichever way the step's rows fall (runs of one length and consecutive slots take the
batched path, others one run at a time)."""

from __future__ import annotations

import pytest
import torch

from engine.lora.rows import NO_ADAPTER, LoRARows
from engine.lora.slots import LoRASlots

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
