"""One projection's adapter slots, and the per-row low-rank update added to its base output.

A and B of up to ``max_loras`` adapters live in fixed buffers (A [max_loras, width, in] and B
transposed, [max_loras, width, out]; width = rank x the HF modules fused into this projection). The
base matmul runs once for every row; then each row with an adapter gets ``(x[row] @ A.T) @ B.T``
added. On CPU with the native kernels, single-token rows (decodes; every row with batch invariance)
get it through the row kernel, one call for the projection's rows (lora_ops.c, also what the native
decode path runs, so both give the same bits, and each row's result is the same whatever else its
step holds); the rows of a prefill chunk otherwise, and every row elsewhere, through two PyTorch
matmuls per adapter over its rows, a contiguous slice ("grouped by adapter": measured faster than
gathering A and B per row, see docs/engine.md). Rows without an adapter get nothing added.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from bulkinfer.engine.invariant import in_row_blocks
from bulkinfer.engine.lora.rows import LoRARows

if TYPE_CHECKING:
    from bulkinfer.engine.cpu_kernels import CpuKernels


class LoRASlots:
    def __init__(self, max_loras: int, max_width: int, in_features: int, out_features: int,
                 dtype: torch.dtype, device: torch.device, step_rows: Any) -> None:
        self.a = torch.zeros(max_loras, max_width, in_features, dtype=dtype, device=device)
        self.bt = torch.zeros(max_loras, max_width, out_features, dtype=dtype, device=device)
        self.widths = [0] * max_loras  # 0: the adapter in that slot leaves this projection alone
        # The model's StepRows: its `lora` (a LoRARows, or None) says this step's rows' slots.
        self.step_rows = step_rows
        # The native kernels where the row kernel takes this projection (set by the model's
        # use_cpu_kernels through the LoRA manager); None: the PyTorch matmuls only.
        self.kernels: CpuKernels | None = None
        # For the row kernel, each slot's A [k, in] and B [out, k] packed (k: the width, in bf16
        # rounded up to whole 32-wide tiles with zeros), their addresses and k (0: none) as int64
        # arrays lora_ops.c reads; the packed tensors are kept here, alive.
        self._packed: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * max_loras
        self.packed_a = torch.zeros(max_loras, dtype=torch.int64)
        self.packed_b = torch.zeros(max_loras, dtype=torch.int64)
        self.packed_widths = torch.zeros(max_loras, dtype=torch.int64)

    def use_kernels(self, kernels: CpuKernels | None) -> None:
        """Apply single-token rows' updates through the row kernel where it takes this projection's
        dtype and shapes on this CPU (bf16: the input width in whole 32-wide tiles)."""
        a = self.a
        usable = (kernels is not None and a.device.type == "cpu" and a.dtype in kernels.row_gemm_dtypes
                  and (a.dtype != torch.bfloat16 or a.shape[2] % 32 == 0))
        self.kernels = kernels if usable else None
        for slot in range(len(self.widths)):
            self._pack(slot)

    def load(self, slot: int, weights: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        if weights is None:
            self.widths[slot] = 0
        else:
            a, b = weights
            width = a.shape[0]
            self.a[slot, :width].copy_(a)
            self.bt[slot, :width].copy_(b.T)
            # Zeros past its width: the batched path multiplies every slot at the widest width.
            self.a[slot, width:].zero_()
            self.bt[slot, width:].zero_()
            self.widths[slot] = width
        self._pack(slot)

    def _pack(self, slot: int) -> None:
        width = self.widths[slot]
        if self.kernels is None or width == 0:
            self._packed[slot] = None
            self.packed_a[slot] = self.packed_b[slot] = self.packed_widths[slot] = 0
            return
        k = -(-width // 32) * 32 if self.a.dtype == torch.bfloat16 else width
        a = self.a.new_zeros(k, self.a.shape[2])
        a[:width] = self.a[slot, :width]
        b = self.bt.new_zeros(self.bt.shape[2], k)
        b[:, :width] = self.bt[slot, :width].T
        packed = (self.kernels.pack_row_gemm(a), self.kernels.pack_row_gemm(b))
        self._packed[slot] = packed
        self.packed_a[slot], self.packed_b[slot] = packed[0].data_ptr(), packed[1].data_ptr()
        self.packed_widths[slot] = k

    def add_updates(self, x: torch.Tensor, out: torch.Tensor, rows: LoRARows) -> torch.Tensor:
        """``out`` (the base output of ``x``) plus each row's adapter update, in place."""
        if self.kernels is not None and x.dim() == 2:
            # Single-token rows (they lead the step) through the row kernel, as decode_layers.c
            # applies them; a prefill chunk's rows through oneDNN's matmuls, faster at hundreds of
            # rows an adapter, except with batch invariance (every row through the row kernel, as
            # the base projections: oneDNN rounds by the call's row count).
            every_row = self.step_rows is None or self.step_rows.every_row
            single = rows.num_rows if every_row else min(self.step_rows.single, rows.num_rows)
            if single:
                self.kernels.lora_update_(x[:single], out[:single], rows.slots[:single], self.packed_a,
                                          self.packed_b, self.packed_widths)
            if single < rows.num_rows:
                self._add_by_matmuls(x[single:], out[single:], rows.after(single))
            return out
        if self.step_rows is not None and self.step_rows.every_row:
            return self._add_in_row_blocks(x, out, rows)
        return self._add_by_matmuls(x, out, rows)

    def _add_in_row_blocks(self, x: torch.Tensor, out: torch.Tensor, rows: LoRARows) -> torch.Tensor:
        """Batch invariance without the native kernels: each adapter's rows through its own width
        (never the widest adapter of the step) in fixed row blocks (engine/invariant/row_blocks.py), so
        a row's update does not follow which adapters, or how many rows, share its step."""
        in_features = x.shape[-1]
        for slot, run in rows.groups():
            width = self.widths[slot]
            if width:
                a, bt = self.a[slot, :width], self.bt[slot, :width]

                def add_update(block: torch.Tensor, a: torch.Tensor = a, bt: torch.Tensor = bt
                               ) -> torch.Tensor:
                    # a block of [x | out] rows -> out + (x A^T) B^T, one rounding as addmm_ does
                    return torch.addmm(block[:, in_features:], block[:, :in_features] @ a.T, bt)

                out[run] = in_row_blocks(add_update, torch.cat([x[run], out[run]], dim=1))
        return out

    def _add_by_matmuls(self, x: torch.Tensor, out: torch.Tensor, rows: LoRARows) -> torch.Tensor:
        """Each adapter's rows (a contiguous run) through two PyTorch matmuls."""
        batched = rows.batched() if out.is_contiguous() else None
        if batched is not None:
            span, count, length, first = batched
            width = max(self.widths[first : first + count])
            if width:
                a, bt = self.a[first : first + count, :width], self.bt[first : first + count, :width]
                shrunk = torch.bmm(x[span].reshape(count, length, -1), a.transpose(1, 2))
                out[span].view(count, length, -1).baddbmm_(shrunk, bt)
            return out
        for slot, run in rows.groups():
            width = self.widths[slot]
            if width:
                out[run].addmm_(x[run] @ self.a[slot, :width].T, self.bt[slot, :width])
        return out
