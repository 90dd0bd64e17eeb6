"""Pure decode steps through fixed-shape inputs, replayed as CUDA graphs on a GPU.

Why: a GPU decode step of a small model is bound by the host, not the device. Every layer is a
dozen or more PyTorch ops, each a kernel launch with its dispatch, plus the host-side planning of
shared prefixes between them (SmolLM2's shape in bf16 on an H200: 64 ms a step at 128 rows, about
1,700 ops, under 1% of the GPU's FLOPs). A CUDA graph replays a whole forward's kernels in one
launch, but only a forward whose work is fixed: the same shapes and addresses every time and no
host reads in between.

So a pure decode step pads its rows to one of a few batch sizes (`batch_bucket`) and its block
tables to one of a few widths (`width_bucket`), copies its inputs into buffers the graphs read, and
runs attention on `AttentionMetadata.static_decode` (every row's blocks gathered to that width and
masked past its length on the device; no grouping over shared prefixes). One graph per (rows,
width), captured the first time a step needs it, all in one memory pool (one replays at a time and
its logits are copied out before the next). Padded rows decode token 0 at position 0 into slot 0 of
the null block (block 0, never handed out), and their logits are dropped. A step too large for the
gather budget, or a mixed step, keeps the eager path.

On a CPU the same fixed-shape path runs without capture when asked (`decode_graphs=True`): the
tests check its results there; the CPU's native decode path stays its default (faster there).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from bulkinfer.engine.attention import AttentionMetadata
from bulkinfer.engine.graph_capture import FixedShapeGraphs

if TYPE_CHECKING:
    from bulkinfer.engine.models.llama import LlamaForCausalLM

# Batch sizes a graph is captured for: each step pads up to the next (at most a third of its rows).
BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
MIN_WIDTH_BLOCKS = 4
# K+V one layer gathers (rows x width): the graphs' working set on top of the KV cache, which takes
# most of a GPU's memory; a larger step runs eagerly (in chunks).
GRAPH_GATHER_BYTES = 512 << 20


def batch_bucket(rows: int, buckets: Sequence[int] = BATCH_BUCKETS) -> int | None:
    """The batch size `rows` decode rows are padded to; None past the largest."""
    return next((size for size in buckets if size >= rows), None)


def width_bucket(blocks: int, max_blocks: int) -> int:
    """The block-table width `blocks` is padded to: the next power of two, at most `max_blocks`
    (a sequence's most), so a growing context recaptures only a handful of times."""
    return min(max(MIN_WIDTH_BLOCKS, 1 << max(0, blocks - 1).bit_length()), max(max_blocks, blocks))


def decode_graph_mode(device_type: str, wanted: bool | None, capturable: bool) -> tuple[bool, bool]:
    """(whether pure decode steps take the fixed-shape path, whether it is captured as CUDA graphs).

    `wanted`: the `decode_graphs` setting (None: on a GPU only). `capturable`: the model's forward
    records into a graph (no host reads of device data; a MoE model's grouped_mm keeps its offsets on
    the device in bf16 on sm90+ only): a model that is not keeps its GPU decode steps eager by
    default, and runs the fixed-shape path uncaptured where the setting asks for it."""
    use = device_type == "cuda" and capturable if wanted is None else wanted
    return use, use and device_type == "cuda" and capturable


class DecodeGraphs(FixedShapeGraphs):
    """Runs a runner's pure decode steps through fixed-shape buffers; `capture`: as CUDA graphs."""

    what = "a decode step"

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[torch.Tensor], block_size: int,
                 max_model_len: int, max_rows: int, capture: bool, gathers_kv: bool = True) -> None:
        super().__init__(capture)
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_blocks = math.ceil(max_model_len / block_size)
        self.buckets = tuple(size for size in BATCH_BUCKETS if size < max_rows) + (
            batch_bucket(max_rows) or max_rows,)
        self.gathers_kv = gathers_kv  # False: attention reads the cache in place, no gather to bound
        config = model.config
        cache = kv_caches[0]
        self.token_bytes = 2 * config.num_kv_heads * config.head_dim * cache.element_size()  # K and V
        device = cache.device
        rows, width = self.buckets[-1], self.max_blocks
        # The graphs' inputs: written before each replay, read by every graph (their leading rows).
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(rows, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(rows, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(rows, width, dtype=torch.long, device=device)

    def shape_for(self, num_rows: int, num_blocks: int) -> tuple[int, int] | None:
        """(padded rows, padded width) of a decode step, or None where it runs eagerly instead."""
        rows = batch_bucket(num_rows, self.buckets)
        if rows is None:
            return None
        width = width_bucket(num_blocks, self.max_blocks)
        too_large = self.gathers_kv and rows * width * self.block_size * self.token_bytes > GRAPH_GATHER_BYTES
        if too_large or (rows, width) in self.failed:
            return None
        return rows, width

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
            sample_rows: torch.Tensor) -> torch.Tensor | None:
        """The logits of a pure decode step's sampled rows, or None where it does not apply (a
        step with prefill chunks, or too large): run it eagerly then."""
        if metadata.num_prefills or not metadata.num_decodes or self.broken:
            return None
        num_rows, num_blocks = metadata.num_decodes, metadata.decode_block_tables.shape[1]
        shape = self.shape_for(num_rows, num_blocks)
        if shape is None:
            return None
        rows, width = shape
        self._write_inputs(input_ids, positions, metadata, rows, width)
        logits = self._replay(shape)
        if logits is None:
            return None
        return logits.index_select(0, sample_rows)  # a copy: the next replay overwrites the buffer

    def _write_inputs(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                      rows: int, width: int) -> None:
        n, blocks = metadata.num_decodes, metadata.decode_block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(metadata.slot_mapping)
        # Padded rows: token 0 at position 0, into (and reading only) slot 0 of the null block.
        for buffer in (self.input_ids, self.positions, self.slot_mapping):
            buffer[n:rows].zero_()
        host = torch.zeros(rows, width + 1, dtype=torch.long)  # one copy to the device: tables, lens
        host[:n, :blocks] = metadata.decode_block_tables
        host[:, width] = 1
        host[:n, width] = metadata.decode_seq_lens
        on_device = host.to(self.block_tables.device, non_blocking=True)
        self.block_tables[:rows, :width].copy_(on_device[:, :width])
        self.seq_lens[:rows].copy_(on_device[:, width])

    def _forward(self, *key: int) -> torch.Tensor:
        """Logits of every padded row, from the buffers (a fresh metadata: its step cache is
        computed inside the forward, so a capture records it)."""
        rows, width = key
        metadata = AttentionMetadata(
            block_size=self.block_size, slot_mapping=self.slot_mapping[:rows], num_decodes=rows,
            decode_seq_lens=self.seq_lens[:rows], decode_block_tables=self.block_tables[:rows, :width],
            static_decode=True,
        )
        hidden = self.model(self.input_ids[:rows], self.positions[:rows], metadata, self.kv_caches)
        return self.model.compute_logits(hidden)

    def _device(self) -> torch.device:
        return self.input_ids.device
