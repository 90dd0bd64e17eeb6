"""One step's rows flattened into the tensors a forward pass reads (no padding between rows).

`prepare_rows` lays a step's rows end to end (single-token decode rows first, so attention batches
them), with their positions, slot mapping, block tables and the rows the LM head samples;
`ModelRunner.batch_rows_with_placeholders` turns a `SchedulerOutput` into those rows, plain decode
rows as columns over the persistent block tables (engine/persistent_batch.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from bulkinfer.engine.attention import AttentionMetadata
from bulkinfer.engine.device_step import PlaceholderInputs
from bulkinfer.engine.kv_connector.connector import KVLoad
from bulkinfer.engine.lora.rows import NO_ADAPTER, LoRARows
from bulkinfer.engine.models.layers import FinalRows
from bulkinfer.engine.models.llama import LlamaForCausalLM
from bulkinfer.engine.multimodal.inputs import MultiModalItem
from bulkinfer.engine.multimodal.mrope import StepRopeRows
from bulkinfer.engine.multimodal.step_embeds import StepImageEmbeds
from bulkinfer.engine.persistent_batch import BlockTables, DecodeColumns
from bulkinfer.engine.prompt_logprobs import ScoreSpan
from bulkinfer.engine.request import Request
from bulkinfer.engine.scheduler import ScheduledChunk


@dataclass
class PreparedStep:
    """A step made ready on the host: its batch (None: no row computes), its rows (what the other
    tensor-parallel ranks are sent), the prefix blocks to copy in first, and the inputs the
    previous step's sampled ids fill (async scheduling)."""

    batch: StepBatch | None
    rows: list[BatchRow]
    kv_loads: list[KVLoad]
    placeholders: PlaceholderInputs | None = None


@dataclass
class StepBatch:
    """The flattened inputs of one step."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    metadata: AttentionMetadata
    sample_rows: torch.Tensor  # [num_sampling] flat index of each sampling chunk's last token,
    # then the rows scored for prompt_logprobs (`score_spans`' positions, in order)
    # Where fewer positions are sampled than computed (a step with prefill chunks): the rows the
    # last layer finishes. None: all (every row samples).
    final_rows: FinalRows | None = None
    score_spans: list[ScoreSpan] = field(default_factory=list)
    num_scored: int = 0  # the last rows of sample_rows that are scored, not sampled
    # [T] each token's adapter slot (NO_ADAPTER: the base model); None when no row has an adapter.
    lora_slots: torch.Tensor | None = None
    # Each given row's end in the flat batch (exclusive), in the rows' own order.
    row_ends: list[int] = field(default_factory=list)
    # Image encoder rows in place of image tokens' embeddings (engine/multimodal/step_embeds.py).
    image_embeds: StepImageEmbeds | None = None
    # M-RoPE rows: image tokens' three-part positions (engine/multimodal/mrope.py).
    rope_rows: StepRopeRows | None = None

    def sampled_hidden(self, model: LlamaForCausalLM, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """Forward the batch: the final hidden states of its sampled positions, in their order."""
        model.step_rows.lora = LoRARows(self.lora_slots) if self.lora_slots is not None else None
        model.step_rows.images = self.image_embeds
        model.step_rows.rope_rows = self.rope_rows
        try:
            hidden = model(self.input_ids, self.positions, self.metadata, kv_caches,
                           final_rows=self.final_rows)
        finally:
            model.step_rows.lora = None  # other forwards (profiling, probes) run the base model
            model.step_rows.images = None
            model.step_rows.rope_rows = None
        if self.final_rows is None:
            return hidden[self.sample_rows]
        return hidden[self.final_rows.order]


@dataclass
class StepRows:
    """A step's rows before they are flattened (ModelRunner.batch_rows_with_placeholders)."""

    rows: list[BatchRow] = field(default_factory=list)
    spans: list[ScoreSpan] = field(default_factory=list)
    # (row index, request id) of rows whose last input token is a placeholder.
    placeholders: list[tuple[int, str]] = field(default_factory=list)
    decodes: DecodeColumns | None = None  # plain decode rows as columns (the persistent batch)
    units: list[int] | None = None  # the rows' own order over columns (d) and rows (~r)
    column_placeholders: list[tuple[int, str]] = field(default_factory=list)
    # (row index, the request's images, prompt start, end) of rows that compute image positions.
    image_rows: list[tuple[int, tuple[MultiModalItem, ...], int, int]] = field(default_factory=list)
    # (row index, request) of the rows of requests with M-RoPE positions (engine/multimodal/mrope.py).
    rope_rows: list[tuple[int, Request]] = field(default_factory=list)


def known_tokens(tokens: Sequence[int], start: int, end: int) -> list[int]:
    """tokens[start:end], a 0 standing in for the one past the known ones (a placeholder)."""
    known = list(tokens[start:end])
    if len(known) < end - start:
        known.append(0)
    return known


def invariant_rows(chunk: ScheduledChunk, lora_slot: int, score: tuple[int, int] | None) -> list[BatchRow]:
    """A chunk's rows computed as the row alone computes them, whatever the schedule: prompt positions
    as a prefill row (even a chunk's single last prompt token, which would otherwise be a decode
    row), generated positions as solo decode rows (a preempted request's recompute repeats the
    decode kernel its tokens first came from, not the prefill kernel). The kernels round
    differently, so which one a position runs through must depend on the position alone."""
    request, start, end = chunk.request, chunk.start, chunk.start + chunk.num_new_tokens
    prompt_end = min(max(request.num_prompt_tokens, start), end)
    tokens = request.all_token_ids
    rows = []
    if prompt_end > start:
        rows.append(BatchRow(tokens[start:prompt_end], start, chunk.block_ids,
                             chunk.num_sample_rows if prompt_end == end else 0, score=score,
                             lora_slot=lora_slot, decode=False))
    rows.extend(BatchRow(known_tokens(tokens, position, position + 1), position, chunk.block_ids,
                         chunk.num_sample_rows if position == end - 1 else 0, solo=end - prompt_end > 1,
                         lora_slot=lora_slot, decode=True)
                for position in range(prompt_end, end))
    return rows


@dataclass(frozen=True, slots=True)
class BatchRow:
    """One sequence's new tokens in a forward pass."""

    token_ids: list[int]  # computed from position `start`
    start: int
    block_ids: Sequence[int]  # the sequence's block table, covering start + len(token_ids)
    num_sample_rows: int  # logits wanted for this many last positions (0 for a partial prefill)
    solo: bool = False  # a decode row computed as if alone (no shared-prefix grouping)
    # (offset, count): positions of this row, from `offset` in its tokens, scored for prompt_logprobs.
    score: tuple[int, int] | None = None
    lora_slot: int = NO_ADAPTER  # the adapter slot its tokens run with
    # Through the decode path (True) or the prefill path (False); None: by its number of tokens.
    decode: bool | None = None

    @property
    def is_decode(self) -> bool:
        return len(self.token_ids) == 1 if self.decode is None else self.decode


def prepare_rows(rows: Sequence[BatchRow], block_size: int, device: torch.device,
                 decodes: DecodeColumns | None = None, units: Sequence[int] | None = None,
                 tables: BlockTables | None = None) -> StepBatch | None:
    """Flatten rows into one batch (no padding between them): single-token rows first so attention
    batches them; the sampled positions come back in the rows' own order.

    `decodes`: plain decode rows as columns, their tables in `tables` (the persistent batch); they
    come first. `units` then gives the rows' own order over both: d >= 0 is decode column d, ~r
    (negative) is rows[r]."""
    num_columns = len(decodes) if decodes is not None else 0
    if not rows and not num_columns:
        return None
    bs = block_size
    # Decode (single-token) rows first; within each kind, rows by adapter, so each adapter's rows are one
    # slice of the batch (engine/lora/rows.py). Stable: without LoRA rows the order is the given one.
    order = sorted(range(len(rows)), key=lambda i: (not rows[i].is_decode, rows[i].lora_slot))
    num_decodes = num_columns + sum(1 for row in rows if row.is_decode)

    starts: list[int] = []
    query_lens: list[int] = []
    row_tables: list[list[int]] = []
    for i in order:
        row = rows[i]
        start, n = row.start, len(row.token_ids)
        starts.append(start)
        query_lens.append(n)
        row_tables.append(list(row.block_ids[: -(-(start + n) // bs)]))

    dev = device
    num_rows = num_columns + len(order)
    starts_np = np.array(starts, dtype=np.int64)
    query_lens_np = np.array(query_lens, dtype=np.int64)
    if num_columns:
        assert decodes is not None and tables is not None, "decode columns need their block tables"
        starts_np = np.concatenate([np.array(decodes.starts, dtype=np.int64), starts_np])
        query_lens_np = np.concatenate([np.ones(num_columns, dtype=np.int64), query_lens_np])
    seq_lens_np = starts_np + query_lens_np
    query_start_loc_np = np.zeros(num_rows + 1, dtype=np.int64)
    np.cumsum(query_lens_np, out=query_start_loc_np[1:])
    num_tokens = int(query_start_loc_np[-1])
    if num_tokens == num_rows:  # one token a row: a decode step
        row_of_token = np.arange(num_rows)
        positions_np = starts_np
    else:
        row_of_token = np.repeat(np.arange(num_rows), query_lens_np)
        positions_np = np.arange(num_tokens) - query_start_loc_np[row_of_token] + starts_np[row_of_token]
    width = int(-(-seq_lens_np.max() // bs))
    if num_columns:
        assert decodes is not None and tables is not None
        block_tables_np = np.zeros((num_rows, width), dtype=np.int64)
        slots = tables.rows(decodes.request_ids, decodes.block_lists)
        usable = min(width, tables.table.shape[1])
        block_tables_np[:num_columns, :usable] = tables.table[slots, :usable]
        if row_tables:
            block_tables_np[num_columns:] = padded_block_tables(row_tables, width).numpy()
        block_tables = torch.from_numpy(block_tables_np)
    else:
        block_tables = padded_block_tables(row_tables, width)
        block_tables_np = block_tables.numpy()
    slot_mapping_np = block_tables_np[row_of_token, positions_np // bs] * bs + positions_np % bs

    # Sampled positions, in the rows' own order: the last num_sample_rows of each.
    qsl = query_start_loc_np.tolist()
    row_in_batch = {row_index: num_columns + batch_row for batch_row, row_index in enumerate(order)}
    row_ends = [qsl[row_in_batch[i] + 1] for i in range(len(rows))]
    sample_rows: list[int] = []
    if units is None:
        for row, end in zip(rows, row_ends, strict=True):
            sample_rows.extend(range(end - row.num_sample_rows, end))
    elif not rows:
        assert decodes is not None
        sample_rows = [d for d, samples in enumerate(decodes.samples) if samples]
    else:
        assert decodes is not None
        for unit in units:
            if unit >= 0:
                if decodes.samples[unit]:
                    sample_rows.append(unit)
            else:
                end = row_ends[~unit]
                sample_rows.extend(range(end - rows[~unit].num_sample_rows, end))
    # Then the scored positions (never a sampled one: they lie before the last prompt token).
    num_scored = 0
    for i, row in enumerate(rows):
        if row.score is not None:
            begin = qsl[row_in_batch[i]] + row.score[0]
            sample_rows.extend(range(begin, begin + row.score[1]))
            num_scored += row.score[1]

    seq_lens_t = torch.from_numpy(seq_lens_np)
    decode_blocks = int(-(-seq_lens_np[:num_decodes].max() // bs)) if num_decodes else 1
    row_solo = [rows[i].solo for i in order[: num_decodes - num_columns]]
    column_solo = decodes.solo if decodes is not None and decodes.solo is not None else [False] * num_columns
    any_solo = any(row_solo) or any(column_solo)
    solo = torch.tensor(column_solo + row_solo, dtype=torch.bool) if any_solo else None
    prefill_tables = row_tables[num_decodes - num_columns:]
    metadata = AttentionMetadata(
        block_size=bs,
        slot_mapping=to_device(torch.from_numpy(slot_mapping_np), dev),
        num_decodes=num_decodes,
        decode_seq_lens=seq_lens_t[:num_decodes],
        decode_block_tables=block_tables[:num_decodes, :decode_blocks],
        decode_solo=solo,
        prefill_query_starts=qsl[num_decodes:-1],
        prefill_query_lens=query_lens_np[num_decodes:].tolist(),
        prefill_seq_lens=seq_lens_np[num_decodes:].tolist(),
        prefill_block_tables=[to_device(torch.tensor(t, dtype=torch.long), dev) for t in prefill_tables],
        prefill_block_lists=prefill_tables,
        query_start_loc=torch.from_numpy(query_start_loc_np),
        seq_lens=seq_lens_t,
        block_tables=block_tables,
    )
    token_ids = list(itertools.chain.from_iterable(rows[i].token_ids for i in order))
    if num_columns:
        assert decodes is not None
        token_ids = decodes.token_ids + token_ids
    return StepBatch(
        input_ids=to_device(torch.tensor(token_ids, dtype=torch.long), dev),
        positions=to_device(torch.from_numpy(positions_np), dev),
        metadata=metadata,
        sample_rows=to_device(torch.tensor(sample_rows, dtype=torch.long), dev),
        final_rows=final_rows_of(sample_rows, num_tokens, num_decodes, dev),
        num_scored=num_scored,
        lora_slots=_lora_slots(rows, order, torch.from_numpy(query_lens_np[num_columns:]), dev)
        if rows else None,
        row_ends=row_ends,
    )


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A step input on its device. On a GPU through pinned memory without waiting: a copy from pageable
    memory waits for the stream's queued kernels, which, with async scheduling, are the previous
    step's (the host would stall on the device it is meant to run ahead of)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _lora_slots(rows: Sequence[BatchRow], order: Sequence[int], query_lens: torch.Tensor,
                device: torch.device) -> torch.Tensor | None:
    """Each token's adapter slot in batch order; None when every row runs the base model."""
    slots = [rows[i].lora_slot for i in order]
    if all(slot == NO_ADAPTER for slot in slots):
        return None
    return to_device(torch.repeat_interleave(torch.tensor(slots, dtype=torch.long), query_lens), device)


def final_rows_of(sample_rows: Sequence[int], num_tokens: int, num_single: int,
                  device: torch.device) -> FinalRows | None:
    """The rows the last layer must finish: the sampled ones, where they are fewer than the rows
    (`num_single`: the batch's leading single-token rows)."""
    if len(sample_rows) == num_tokens:
        return None
    ascending = sorted(sample_rows)
    index = {row: i for i, row in enumerate(ascending)}
    return FinalRows(
        rows=to_device(torch.tensor(ascending, dtype=torch.long), device),
        num_single=sum(1 for row in ascending if row < num_single),
        order=to_device(torch.tensor([index[row] for row in sample_rows], dtype=torch.long), device),
    )


def padded_block_tables(tables: Sequence[Sequence[int]], width: int) -> torch.Tensor:
    """[rows, width] int64 block tables, each row padded with block 0: filled in one numpy pass
    from the flattened ids (a nested list through torch.tensor took 0.69 of a 256-row decode
    step's 1.17 ms of batch preparation; this takes 0.16), which a GPU step with its forward
    replayed as a graph waits on."""
    lengths = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    flat = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int64, count=int(lengths.sum()))
    padded = np.zeros((len(tables), width), dtype=np.int64)
    padded[np.arange(width)[None, :] < lengths[:, None]] = flat
    return torch.from_numpy(padded)
