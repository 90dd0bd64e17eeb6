"""One projection's adapter slots, and the per-row low-rank update added to its base output.

A and B of up to ``max_loras`` adapters live in fixed buffers ([max_loras, width, in] and
[max_loras, out, width]; width = rank x the HF modules fused into this projection). The base
matmul runs once for every row; then each adapter present in the step adds
``(x[rows] @ A.T) @ B.T`` to its own rows, a contiguous slice ("grouped by adapter": measured
faster on CPU than gathering A and B per row, see docs/engine.md). Rows without an adapter get
nothing added.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.lora.rows import LoRARows


class LoRASlots:
    def __init__(self, max_loras: int, max_width: int, in_features: int, out_features: int,
                 dtype: torch.dtype, device: torch.device, step_rows: Any) -> None:
        self.a = torch.zeros(max_loras, max_width, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(max_loras, out_features, max_width, dtype=dtype, device=device)
        self.widths = [0] * max_loras  # 0: the adapter in that slot leaves this projection alone
        # The model's StepRows: its `lora` (a LoRARows, or None) says this step's rows' slots.
        self.step_rows = step_rows

    def load(self, slot: int, weights: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        if weights is None:
            self.widths[slot] = 0
            return
        a, b = weights
        width = a.shape[0]
        self.a[slot, :width].copy_(a)
        self.b[slot, :, :width].copy_(b)
        # Zeros past its width: the batched path multiplies every slot at the widest width.
        self.a[slot, width:].zero_()
        self.b[slot, :, width:].zero_()
        self.widths[slot] = width

    def add_updates(self, x: torch.Tensor, out: torch.Tensor, rows: LoRARows) -> torch.Tensor:
        """``out`` (the base output of ``x``) plus each row's adapter update, in place."""
        batched = rows.batched() if out.is_contiguous() else None
        if batched is not None:
            span, count, length, first = batched
            width = max(self.widths[first : first + count])
            if width:
                a, b = self.a[first : first + count, :width], self.b[first : first + count, :, :width]
                shrunk = torch.bmm(x[span].reshape(count, length, -1), a.transpose(1, 2))
                out[span].view(count, length, -1).baddbmm_(shrunk, b.transpose(1, 2))
            return out
        for slot, run in rows.groups():
            width = self.widths[slot]
            if width:
                out[run].addmm_(x[run] @ self.a[slot, :width].T, self.b[slot, :, :width].T)
        return out
