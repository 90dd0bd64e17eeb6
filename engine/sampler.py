"""Batched token sampling: greedy, temperature, top-k, top-p, with an optional seed per request.

All rows of a step are processed with tensor ops. Randomness is one uniform number per row,
turned into a token by inverse-CDF over the filtered distribution; a seeded request draws its
number from its own ``torch.Generator``, so its tokens depend only on its seed and its logits —
never on which other requests share the batch.

To add a logits processor (penalties, min-p, grammar masks), transform ``logits`` in ``sample``
before ``_filter``; ``SamplingBatch`` is where its per-row tensors belong.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams


@dataclass
class SamplingBatch:
    """Per-row sampling settings of one step, as tensors."""

    temperatures: torch.Tensor  # [N] float; 0 = greedy
    top_k: torch.Tensor  # [N] int; 0 = off
    top_p: torch.Tensor  # [N] float; 1 = off
    generators: list[torch.Generator | None]  # per row; None = the sampler's shared generator
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool

    @staticmethod
    def build(params: list[SamplingParams], generators: list[torch.Generator | None]) -> SamplingBatch:
        temperatures = [p.temperature for p in params]
        top_k = [max(p.top_k, 0) for p in params]
        top_p = [p.top_p for p in params]
        return SamplingBatch(
            temperatures=torch.tensor(temperatures, dtype=torch.float32),
            top_k=torch.tensor(top_k, dtype=torch.long),
            top_p=torch.tensor(top_p, dtype=torch.float32),
            generators=generators,
            all_greedy=all(t == 0.0 for t in temperatures),
            any_top_k=any(k > 0 for k in top_k),
            any_top_p=any(p < 1.0 for p in top_p),
        )


def request_generator(seed: int | None) -> torch.Generator | None:
    """The private generator of a seeded request (created once, at admission)."""
    if seed is None:
        return None
    return torch.Generator().manual_seed(seed)


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        # Unseeded requests share this generator: reproducible per engine run, not per request.
        self.generator = torch.Generator().manual_seed(seed)

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> list[int]:
        """logits [N, vocab] (fp32) -> one token id per row."""
        logits = logits.float().cpu()
        greedy_tokens = logits.argmax(dim=-1)
        if batch.all_greedy:
            return greedy_tokens.tolist()

        is_greedy = batch.temperatures == 0.0
        # Greedy rows get temperature 1 here; their result is replaced by argmax below.
        temperatures = torch.where(is_greedy, torch.ones_like(batch.temperatures), batch.temperatures)
        scaled = logits / temperatures[:, None]
        sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True)
        sorted_logits = self._filter(sorted_logits, batch)
        probs = torch.softmax(sorted_logits, dim=-1)
        cdf = probs.cumsum(dim=-1)
        uniforms = self._uniforms(batch.generators) * cdf[:, -1]
        index = torch.searchsorted(cdf, uniforms[:, None], right=True)
        # Rounding can put u at the very top of the cdf: stay on the last token that was kept.
        last_kept = (sorted_logits > float("-inf")).sum(dim=-1, keepdim=True) - 1
        index = torch.minimum(index, last_kept)
        sampled = sorted_ids.gather(1, index)[:, 0]
        return torch.where(is_greedy, greedy_tokens, sampled).tolist()

    @staticmethod
    def _filter(sorted_logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Top-k then top-p on logits sorted in descending order; removed entries become -inf."""
        vocab = sorted_logits.shape[-1]
        rank = torch.arange(vocab)[None, :]
        if batch.any_top_k:
            k = torch.where(batch.top_k > 0, batch.top_k, torch.full_like(batch.top_k, vocab))
            sorted_logits = sorted_logits.masked_fill(rank >= k[:, None], float("-inf"))
        if batch.any_top_p:
            probs = torch.softmax(sorted_logits, dim=-1)
            # Keep a token if the mass strictly before it is below top_p (the top token always stays).
            mass_before = probs.cumsum(dim=-1) - probs
            sorted_logits = sorted_logits.masked_fill(mass_before >= batch.top_p[:, None], float("-inf"))
        return sorted_logits

    def _uniforms(self, generators: list[torch.Generator | None]) -> torch.Tensor:
        shared = torch.rand(len(generators), generator=self.generator)
        # Only seeded rows need their own draw: one scalar each, from their own stream.
        for row, generator in enumerate(generators):
            if generator is not None:
                shared[row] = torch.rand(1, generator=generator)[0]
        return shared
