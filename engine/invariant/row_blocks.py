"""Per-row ops in blocks of a fixed row count, so each call has the same shape whatever the step.

GEMM libraries choose kernels by the row count (oneDNN's bf16 GEMM takes another kernel at 33-600
rows; cuBLAS picks its tiling and split-K by shape) and reductions choose their thread split by the
number of rows (a lone row's mean can be split across threads). Through blocks of exactly
``INVARIANT_BLOCK_ROWS`` rows every call sees one shape, and a row's result is the same whichever
block, and whichever position in it, it lands in (tests/engine/test_invariant_ops.py checks it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# Rows per call. 64: on the CPU the blocked projections of a bench step ran within noise of 128 and
# faster than 32 (fewer, larger GEMMs); on a GPU a decode step's GEMM reads all the weights whatever
# the rows, so padding a few decode rows to 64 costs little, and prefill's blocks stay GEMM-sized.
INVARIANT_BLOCK_ROWS = 64
# Prefill rows per call where a step's rows are told apart (a projection of the flattened step): a
# prompt position is always a prefill row and a generated one a decode row (engine/model_runner.py
# invariant_rows), so the two kinds may take different blocks. Larger: every block re-reads the
# weights, which in 64-row blocks made a 2k-token prefill's GEMMs the run's largest cost.
PREFILL_BLOCK_ROWS = 256
# The LM head's sampled rows per call (fp32 sums): its weight is the largest (vocabulary x hidden),
# and a decode step samples few rows, so padding them to 64 cost 6 ms a step on the `small` preset.
LOGIT_BLOCK_ROWS = 16
# Operands start on this boundary (MKL documents results that may vary with alignment; a GPU's
# vectorised loads want 16 bytes at least).
_ALIGNMENT_BYTES = 64


def in_row_blocks(op: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                  block_rows: int = INVARIANT_BLOCK_ROWS) -> torch.Tensor:
    """``op(x)`` for an ``op`` that maps each row of ``x [rows, ...]`` alone (a projection, a norm),
    called on blocks of exactly ``block_rows`` rows: whole blocks where they lie aligned in ``x``,
    the rest copied into a zeroed buffer of one block (padding rows are computed and dropped)."""
    rows = x.shape[0]
    if rows == 0:
        return op(x)
    x = x.contiguous()
    pieces = []
    for first in range(0, rows, block_rows):
        block = x[first:first + block_rows]
        count = block.shape[0]
        if count < block_rows or block.data_ptr() % _ALIGNMENT_BYTES:
            padded = torch.zeros((block_rows, *x.shape[1:]), dtype=x.dtype, device=x.device)
            padded[:count] = block
            block = padded
        pieces.append(op(block)[:count])
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def in_step_row_blocks(op: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                       single: int | None) -> torch.Tensor:
    """``in_row_blocks`` for a step's flattened rows whose first ``single`` are single-token (decode)
    rows: those in blocks of INVARIANT_BLOCK_ROWS, the prefill rows after them in blocks of
    PREFILL_BLOCK_ROWS. ``single`` None: the rows are not told apart (all in the smaller blocks)."""
    rows = x.shape[0]
    if single is None or single >= rows:
        return in_row_blocks(op, x)
    if single <= 0:
        return in_row_blocks(op, x, PREFILL_BLOCK_ROWS)
    return torch.cat([in_row_blocks(op, x[:single]), in_row_blocks(op, x[single:], PREFILL_BLOCK_ROWS)])


__all__ = ["INVARIANT_BLOCK_ROWS", "LOGIT_BLOCK_ROWS", "PREFILL_BLOCK_ROWS", "in_row_blocks",
           "in_step_row_blocks"]
