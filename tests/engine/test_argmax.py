"""argmax_rows is torch.argmax exactly: random rows, ties (the first index wins), a vocabulary that is
not a multiple of the block, the maximum in the tail, every dtype the engine samples from."""

from __future__ import annotations

import pytest
import torch

from bulkinfer.engine.argmax import BLOCK, argmax_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [49152, 32000, 151936, 4 * BLOCK + 7, 1000])
def test_argmax_rows_equals_torch_argmax(dtype: torch.dtype, vocab: int) -> None:
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(37, vocab, generator=generator).to(dtype)
    logits[0] = 0.0  # all tied: index 0
    logits[1, [5, min(BLOCK + 3, vocab - 2), vocab - 1]] = 50.0  # tied across blocks and the tail: the first
    logits[2, vocab - 1] = 60.0  # the maximum in the tail
    logits[3, min(BLOCK, vocab) - 1] = logits[3, min(BLOCK, vocab - 1)] = 70.0  # tied at a block boundary
    logits[4] = logits[4].round()  # many ties (bf16/fp16 rounding makes more)
    ours = argmax_rows(logits)
    assert ours.dtype == torch.int64
    assert torch.equal(ours, logits.argmax(dim=-1))


def test_argmax_rows_of_no_rows() -> None:
    assert argmax_rows(torch.empty(0, 49152)).shape == (0,)
