"""Batch invariance where no native CPU kernel runs an op (issue 45): on CUDA with
``batch_invariant=True``, and on a CPU with the kernels off or unsupported.

The principle is fixed shapes: a library kernel (oneDNN, MKL, cuBLAS, SDPA) picks its algorithm,
blocking and thread split from the shapes it is called with, so a row's bits follow the step's row
count. Called with the same shapes every time (and aligned, contiguous operands) it takes the same
path, and a row's result then depends on its own data alone:

- ``row_blocks``: projections and per-row reductions (norms) over blocks of exactly
  ``INVARIANT_BLOCK_ROWS`` rows, the last one zero-padded (a step's prefill rows, where a projection
  tells them apart, in blocks of ``PREFILL_BLOCK_ROWS``).
- ``tiled_attention``: each query's keys in fixed tiles from key 0 of its sequence, merged tile by
  tile (online softmax), queries in fixed blocks: chunked or not, cached prefix or computed, alone or
  beside long rows, a query reads the same tiles in the same order.
- ``cuda_settings``: what cuBLAS needs besides (no reduced-precision split-K reductions, one
  workspace configuration).
"""

from bulkinfer.engine.invariant.row_blocks import (
    INVARIANT_BLOCK_ROWS,
    LOGIT_BLOCK_ROWS,
    PREFILL_BLOCK_ROWS,
    in_row_blocks,
    in_step_row_blocks,
)

__all__ = ["INVARIANT_BLOCK_ROWS", "LOGIT_BLOCK_ROWS", "PREFILL_BLOCK_ROWS", "in_row_blocks",
           "in_step_row_blocks"]
