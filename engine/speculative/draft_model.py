"""Draft-model proposals: a smaller model with the target's vocabulary decodes the drafts greedily.

Its paged KV cache mirrors the target's block layout: same block size and block count, and each
request's draft KV lives in the request's own target blocks (the scheduler's block table), so the
target's allocator, preemption and rollback manage it with no second allocator. The draft catches
up lazily, only for requests that speculate: it remembers up to where its KV holds the request's
actual tokens (drafts it fed in count only where the target accepted them) and computes the rest
first. A request the draft has not seen (or that was preempted) starts from position 0, so a
prefix-cache hit never hands it a block whose draft KV another model state wrote.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from bulkinfer.engine.argmax import argmax_rows
from bulkinfer.engine.attention import AttentionBackend, TorchPagedAttention
from bulkinfer.engine.cpu_kernels import CpuKernels
from bulkinfer.engine.kv_memory import allocate_kv_caches
from bulkinfer.engine.models.loader import load_model, model_config_from_dir
from bulkinfer.engine.request import Request
from bulkinfer.engine.step_batch import BatchRow, prepare_rows


@dataclass
class _DraftState:
    base: int  # positions [0, base) hold the request's tokens as they were when drafting
    fed: list[int]  # drafts fed in after them, at positions base, base + 1, ...
    num_preemptions: int


class DraftModel:
    """The draft model, its KV cache, and where each request's draft KV stands."""

    def __init__(self, path: str, *, target_vocab_size: int, max_model_len: int, dtype: torch.dtype,
                 device: str, block_size: int, kernels: CpuKernels | None,
                 attention: AttentionBackend | None = None) -> None:
        config = model_config_from_dir(path)
        if config.vocab_size != target_vocab_size:
            raise ValueError(
                f"speculative_config.model {path!r} has a vocabulary of {config.vocab_size} tokens; "
                f"the target's has {target_vocab_size} (a draft model must share the tokenizer)"
            )
        if config.max_position_embeddings < max_model_len:
            raise ValueError(
                f"speculative_config.model {path!r} handles {config.max_position_embeddings} positions, "
                f"fewer than max_model_len={max_model_len}"
            )
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        self.block_size = block_size
        attention = attention or TorchPagedAttention(kernels=kernels)
        self.model = load_model(path, attention, dtype=dtype, device=device)
        self.model.use_cpu_kernels(kernels)
        self.kv_caches: list[torch.Tensor] = []
        self._states: dict[str, _DraftState] = {}

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of draft KV across its layers."""
        c = self.config
        return 2 * self.block_size * c.num_kv_heads * c.head_dim * self.dtype.itemsize * c.num_layers

    def allocate(self, num_blocks: int) -> None:
        self.kv_caches = allocate_kv_caches(self.config, num_blocks, self.block_size, self.dtype, self.device)

    @torch.inference_mode()
    def propose(self, work: Sequence[tuple[Request, Sequence[int], int]]) -> list[list[int]]:
        """Greedy drafts for each (request, its block table, how many): `num` forwards of the draft
        for the longest ask. The block table must hold slots up to num_tokens + num - 1."""
        drafts: list[list[int]] = [[] for _ in work]
        rows = []
        for request, block_ids, _ in work:
            start = self._valid(request)
            rows.append(BatchRow(request.all_token_ids[start:], start, block_ids, 1))
        active = list(range(len(work)))
        depth = 0
        while active:
            tokens = self._forward(rows)
            for i, token in zip(active, tokens, strict=True):
                drafts[i].append(token)
            depth += 1
            active = [i for i in active if work[i][2] > depth]
            rows = [BatchRow([drafts[i][-1]], work[i][0].num_tokens - 1 + depth, work[i][1], 1)
                    for i in active]
        for (request, _, _), tokens in zip(work, drafts, strict=True):
            # The last draft was never fed in: its KV is not in the cache.
            self._states[request.request_id] = _DraftState(request.num_tokens, tokens[:-1],
                                                           request.num_preemptions)
        return drafts

    def release(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def _valid(self, request: Request) -> int:
        """Leading positions whose draft KV holds the request's actual tokens (at least one token
        is always recomputed: its logits give the first draft)."""
        state = self._states.get(request.request_id)
        if state is None or state.num_preemptions != request.num_preemptions:
            return 0
        valid = min(state.base, request.num_tokens)
        actual = request.all_token_ids
        for draft in state.fed:
            if valid >= len(actual) or actual[valid] != draft:
                break
            valid += 1
        return min(valid, request.num_tokens - 1)

    def _forward(self, rows: list[BatchRow]) -> list[int]:
        batch = prepare_rows(rows, self.block_size, self.device)
        assert batch is not None
        hidden = batch.sampled_hidden(self.model, self.kv_caches)
        return argmax_rows(self.model.compute_logits(hidden)).tolist()
