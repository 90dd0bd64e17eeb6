"""Steps with prefill chunks (mixed steps) through fixed-shape inputs, replayed as CUDA graphs on a GPU.

Why: in a batch job most steps carry a prefill chunk beside the decode rows (rows finish and new
prompts take their place), so graphs of pure decode steps alone (decode_graphs.py) leave the
steps that dominate to launch their ~20 kernels a layer one by one. vLLM graphs such steps too
(piecewise, or whole with an attention kernel that reads its layout from the device); here the
attention backend that reads the paged cache in place (engine/gpu_kernels/, one Triton launch a
layer whose grid follows from the token and sequence counts alone) makes the whole step fixed once
those counts are padded:

- tokens pad to a bucket (`TOKEN_BUCKETS`); sequences pad to a bucket of `BATCH_BUCKETS`, with
  at least one padded sequence. The padded tokens are the last padded sequence's (the others have
  none): id 0, its keys in the null block (block 0, never handed out, scratch for padded rows as
  in decode_graphs.py), so every row the graph computes is finite; their rows are dropped;
- the step's layout (query starts, lengths, block tables) and its sampled positions go into
  buffers the graph reads; the longest chunk stands in as long or short (`LONG_QUERY`), which is
  all the kernel's tile shape looks at.

The graph ends in the sampled positions' hidden states; the LM head then runs on the real ones
alone, outside the graph (one matmul: a graph's [rows, vocab] output buffer would cost each
captured shape hundreds of MB). A step with scored prompt positions, adapter rows, more sampled
positions than padded sequences (speculative verification), or more tokens than the largest bucket
runs eagerly. Batch-invariant engines keep mixed steps eager (their row blocks split at the step's
decode count, a host number a graph would freeze).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from bulkinfer.engine.attention import AttentionMetadata
from bulkinfer.engine.decode_graphs import BATCH_BUCKETS, batch_bucket
from bulkinfer.engine.gpu_kernels import LONG_QUERY
from bulkinfer.engine.graph_capture import FixedShapeGraphs

if TYPE_CHECKING:
    from bulkinfer.engine.models.llama import LlamaForCausalLM

# Token counts a mixed step pads to: each is at most 1.5x the one before.
TOKEN_BUCKETS = tuple(sorted({size for power in range(4, 16) for size in (1 << power, 3 << (power - 1))}))


class MixedGraphs(FixedShapeGraphs):
    """Runs a runner's steps with prefill chunks through fixed-shape buffers; `capture`: as CUDA
    graphs. For a model whose attention reads its layout from the device (`TritonPagedAttention`)."""

    what = "a mixed step"

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[torch.Tensor], block_size: int,
                 max_model_len: int, max_rows: int, max_tokens: int, capture: bool) -> None:
        super().__init__(capture)
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.seq_buckets = tuple(size for size in BATCH_BUCKETS if size <= max_rows) + (
            batch_bucket(max_rows + 1) or max_rows + 1,)
        self.token_buckets = tuple(size for size in TOKEN_BUCKETS if size < max_tokens) + (
            batch_bucket(max_tokens, TOKEN_BUCKETS) or max_tokens,)
        device = kv_caches[0].device
        tokens, seqs = self.token_buckets[-1], self.seq_buckets[-1]
        # The graphs' inputs: written before each replay, read by every graph (their leading rows).
        self.input_ids = torch.zeros(tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(tokens, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(tokens, dtype=torch.long, device=device)
        self.query_start_loc = torch.zeros(seqs + 1, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(seqs, dtype=torch.long, device=device)
        # Wide enough for a sequence's blocks and for the padded tokens' (all the null block).
        width = math.ceil(max(max_model_len, tokens) / block_size)
        self.block_tables = torch.zeros(seqs, width, dtype=torch.long, device=device)
        # Padded tokens' positions and slots: 0, 1, ..., block_size - 1, 0, 1, ... (the null block).
        self.padding = torch.arange(tokens, device=device) % block_size
        self.sample_index = torch.zeros(seqs, dtype=torch.long, device=device)

    def shape_for(self, num_tokens: int, num_seqs: int, max_query_len: int) -> tuple[int, int, int] | None:
        """(padded tokens, padded sequences, long chunks or not) of a mixed step, or None where it
        runs eagerly instead."""
        tokens = batch_bucket(num_tokens, self.token_buckets)
        seqs = batch_bucket(num_seqs + 1, self.seq_buckets)  # one padded sequence at least
        if tokens is None or seqs is None:
            return None
        shape = (tokens, seqs, int(max_query_len >= LONG_QUERY))
        return None if shape in self.failed else shape

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
            sample_rows: torch.Tensor) -> torch.Tensor | None:
        """The logits of a mixed step's sampled rows, or None where it does not apply (a pure
        decode step, or one too large): run it eagerly then."""
        if not metadata.num_prefills or self.broken or metadata.query_start_loc is None:
            return None
        assert metadata.seq_lens is not None and metadata.block_tables is not None
        num_seqs, num_sampled = metadata.seq_lens.shape[0], sample_rows.shape[0]
        shape = self.shape_for(input_ids.shape[0], num_seqs, max(metadata.prefill_query_lens))
        if shape is None or num_sampled > shape[1]:
            return None
        self._write_inputs(input_ids, positions, metadata, sample_rows, shape[0], shape[1])
        hidden = self._replay(shape)
        if hidden is None:
            return None
        return self.model.compute_logits(hidden[:num_sampled])

    def _write_inputs(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                      sample_rows: torch.Tensor, tokens: int, seqs: int) -> None:
        assert metadata.query_start_loc is not None and metadata.seq_lens is not None \
            and metadata.block_tables is not None
        n, s, tables = input_ids.shape[0], metadata.seq_lens.shape[0], metadata.block_tables
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(metadata.slot_mapping)
        # Padded tokens: token 0, into (and reading only) the null block.
        self.input_ids[n:tokens].zero_()
        self.positions[n:tokens].copy_(self.padding[:tokens - n])
        self.slot_mapping[n:tokens].copy_(self.padding[:tokens - n])
        # One copy to the device of the sequences' layout: [tables | length | start] per sequence
        # and the step's end. Padded sequences: the null block's tables, starting where the real
        # tokens end, the last one holding the padded tokens.
        width = max(tables.shape[1], -(-(tokens - n) // self.block_size))
        host = torch.zeros(seqs + 1, width + 2, dtype=torch.long)
        host[:s, :tables.shape[1]] = tables
        host[:s, width] = metadata.seq_lens
        host[seqs - 1, width] = tokens - n
        host[:s + 1, width + 1] = metadata.query_start_loc
        host[s + 1:seqs, width + 1] = n
        host[seqs, width + 1] = tokens
        on_device = host.to(self.block_tables.device, non_blocking=True)
        self.block_tables[:seqs, :width].copy_(on_device[:seqs, :width])
        self.seq_lens[:seqs].copy_(on_device[:seqs, width])
        self.query_start_loc[:seqs + 1].copy_(on_device[:, width + 1])
        self.sample_index[:sample_rows.shape[0]].copy_(sample_rows)
        self.sample_index[sample_rows.shape[0]:seqs].zero_()

    def _forward(self, *key: int) -> torch.Tensor:
        """Final hidden states of the padded sampled positions, from the buffers (a fresh metadata:
        its step cache is computed inside the forward, so a capture records it)."""
        tokens, seqs, long = key
        metadata = AttentionMetadata(
            block_size=self.block_size, slot_mapping=self.slot_mapping[:tokens], num_decodes=0,
            decode_seq_lens=self.seq_lens[:0], decode_block_tables=self.block_tables[:0],
            query_start_loc=self.query_start_loc[:seqs + 1], seq_lens=self.seq_lens[:seqs],
            block_tables=self.block_tables[:seqs], static_step=True,
            static_max_query_len=LONG_QUERY if long else 1,
        )
        hidden = self.model(self.input_ids[:tokens], self.positions[:tokens], metadata, self.kv_caches)
        return hidden.index_select(0, self.sample_index[:seqs])

    def _device(self) -> torch.device:
        return self.input_ids.device
