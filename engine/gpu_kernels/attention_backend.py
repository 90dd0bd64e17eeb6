"""The attention backend of GPU steps: one Triton launch writes a step's new K/V to its slots, one
attends every row of the step (decode rows and prefill chunks alike) straight from the paged cache
(engine/gpu_kernels/paged_attention.py). No gathered copies of K/V, no Python loop over chunks, no
host-side planning: a step's sequences are described once per step (``StepLayout``) and every
layer reads that description."""

from __future__ import annotations

import itertools

import torch

from bulkinfer.engine.attention import AttentionBackend, AttentionMetadata
from bulkinfer.engine.gpu_kernels.paged_attention import StepLayout, store_kv, unified_attention
from bulkinfer.engine.step_batch import padded_block_tables

_STEP_KEY = ("triton_step", None)


class TritonPagedAttention(AttentionBackend):
    """Paged attention in Triton. ``batch_invariant``: the same tile shapes every step, so a row's
    bits depend on the row alone (the kernel never splits a row's keys across programs)."""

    gathers_kv = False  # reads the cache in place: a fixed-shape step has no gather to bound

    def __init__(self, batch_invariant: bool = False, softcap: float | None = None) -> None:
        self.batch_invariant = batch_invariant
        self.softcap = softcap

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 metadata: AttentionMetadata) -> None:
        store_kv(key, value, k_cache, v_cache, metadata.slot_mapping)

    def forward(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                metadata: AttentionMetadata, sliding_window: int | None = None,
                key: torch.Tensor | None = None, value: torch.Tensor | None = None) -> torch.Tensor:
        return unified_attention(query, k_cache, v_cache, step_layout(metadata, query.device),
                                 sliding_window=sliding_window, softcap=self.softcap,
                                 fixed_blocks=self.batch_invariant)


def step_layout(metadata: AttentionMetadata, device: torch.device) -> StepLayout:
    """The step's sequences on ``device``, built on the first layer's call and kept for the rest."""
    cached = metadata.step_cache.get(_STEP_KEY)
    if cached is None:
        cached = metadata.step_cache[_STEP_KEY] = _build_layout(metadata, device)
    return cached  # type: ignore[return-value]


def _build_layout(metadata: AttentionMetadata, device: torch.device) -> StepLayout:
    if metadata.static_step:
        # A fixed-shape step with prefill chunks: its whole layout is device buffers already.
        assert metadata.query_start_loc is not None and metadata.seq_lens is not None \
            and metadata.block_tables is not None
        return StepLayout(metadata.query_start_loc, metadata.seq_lens, metadata.block_tables,
                          metadata.static_max_query_len)
    max_query_len = max(metadata.prefill_query_lens, default=1)
    if metadata.static_decode:
        # A fixed-shape decode step (a CUDA graph's): its lengths and tables are device buffers
        # already; every row one token. Nothing is read from the device.
        rows = metadata.decode_seq_lens.shape[0]
        return StepLayout(torch.arange(rows + 1, device=device), metadata.decode_seq_lens,
                          metadata.decode_block_tables, 1)
    if metadata.query_start_loc is not None and metadata.seq_lens is not None \
            and metadata.block_tables is not None:
        starts, seq_lens, tables = metadata.query_start_loc, metadata.seq_lens, metadata.block_tables
    else:
        starts, seq_lens, tables = _host_layout(metadata)
    moved = [tensor.to(device, non_blocking=True) for tensor in (starts, seq_lens, tables)]
    return StepLayout(moved[0], moved[1], moved[2], max_query_len)


def _host_layout(metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(query_start_loc, seq_lens, block_tables) on the host from the per-kind fields, for metadata
    built without them (the start-up profiling pass)."""
    decodes = metadata.num_decodes
    query_lens = [1] * decodes + list(metadata.prefill_query_lens)
    seq_lens = metadata.decode_seq_lens[:decodes].tolist() + list(metadata.prefill_seq_lens)
    tables = metadata.decode_block_tables[:decodes].tolist()
    tables += metadata.prefill_block_lists or [table.tolist() for table in metadata.prefill_block_tables]
    starts = torch.tensor(list(itertools.accumulate(query_lens, initial=0)), dtype=torch.long)
    padded = padded_block_tables(tables, max((len(table) for table in tables), default=1))
    return starts, torch.tensor(seq_lens, dtype=torch.long), padded
