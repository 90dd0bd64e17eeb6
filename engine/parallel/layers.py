"""The modules a rank's model swaps in: the vocabulary-parallel embedding and LM head, and the
all-reduce after each row-parallel module (its output is this rank's partial sum)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from bulkinfer.engine.models.layers import Linear
from bulkinfer.engine.parallel.communicator import Communicator
from bulkinfer.engine.parallel.plan import Split, padded_share


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + share) of the embedding: ids outside them give zeros, and the sum over
    the ranks is the full lookup (exact: one rank holds each id, the others add zeros)."""

    def __init__(self, vocab_size: int, hidden_size: int, communicator: Communicator) -> None:
        super().__init__()
        share = padded_share(vocab_size, communicator.world)
        self.weight = nn.Parameter(torch.empty(share, hidden_size), requires_grad=False)
        self.start = communicator.rank * share
        self.communicator = communicator

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)
        hidden.masked_fill_(outside[:, None], 0)
        return self.communicator.all_reduce_(hidden)


class VocabParallelLMHead(Linear):
    """Each rank's logits for its slice of the vocabulary, gathered to rank 0 (which samples)."""

    def __init__(self, hidden_size: int, vocab_size: int, communicator: Communicator) -> None:
        super().__init__(hidden_size, padded_share(vocab_size, communicator.world), bias=False)
        self.vocab_size = vocab_size
        self.communicator = communicator

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.communicator.gather_columns(super().forward(x), self.vocab_size)

    def forward_fp32(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits over the whole vocabulary (each rank's slice, gathered into a new tensor:
        ``out`` is not used)."""
        return self.communicator.gather_columns(super().forward_fp32(x), self.vocab_size)


def swap_vocab_modules(model: nn.Module, vocab_size: int, communicator: Communicator) -> None:
    """Replace `model.embed_tokens` and `model.lm_head` by their vocabulary-parallel versions (built
    like them, on the current default device: call it where the model was built, e.g. on meta)."""
    embed: Any = model.embed_tokens
    hidden_size = embed.weight.shape[1]
    parallel_embed = VocabParallelEmbedding(vocab_size, hidden_size, communicator)
    model.embed_tokens = parallel_embed
    model.lm_head = VocabParallelLMHead(hidden_size, vocab_size, communicator)


def add_reductions(model: nn.Module, plan: dict[str, Split], communicator: Communicator) -> list[str]:
    """All-reduce the output of every module a split names in `reduce_at`; returns their names."""
    names = sorted({split.reduce_at for split in plan.values() if split.reduce_at})
    for name in names:
        model.get_submodule(name).register_forward_hook(
            lambda _module, _inputs, output: communicator.all_reduce_(output))
    return names
