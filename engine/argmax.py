"""Row-wise argmax over a large vocabulary, several times faster than ``torch.argmax`` on CPU.

``torch.argmax`` over the last dimension of ``[rows, vocab]`` logits runs a scalar loop on CPU
(4 ms for 128 x 49,152 fp32, 11 ms in bf16: a real share of a decode step), while ``amax`` is
vectorized. So: the max of each 1,024-wide block, the first block holding the row's max, then the
argmax inside that one block. The result is ``torch.argmax``'s exactly, ties included (the first
index of the maximum wins).
"""

from __future__ import annotations

import torch

BLOCK = 1024


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` for a 2-D tensor (int64, one index per row)."""
    rows, vocab = logits.shape
    if logits.device.type != "cpu" or vocab < 4 * BLOCK or rows == 0:
        return logits.argmax(dim=-1)
    full = vocab // BLOCK * BLOCK
    blocks = logits[:, :full].reshape(rows, full // BLOCK, BLOCK)
    block_max = blocks.amax(dim=-1)
    best_block = block_max.argmax(dim=-1)  # the first block holding the row's maximum
    row_ids = torch.arange(rows, device=logits.device)
    best = best_block * BLOCK + blocks[row_ids, best_block].argmax(dim=-1)
    if full < vocab:  # the tail wins only where its maximum is strictly larger (it comes last)
        tail = logits[:, full:]
        tail_max, tail_index = tail.max(dim=-1)
        best = torch.where(tail_max > block_max.amax(dim=-1), full + tail_index, best)
    return best
