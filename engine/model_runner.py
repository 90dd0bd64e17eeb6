"""Runs the model for one scheduler step and owns the paged KV cache.

Per step the runner turns a ``SchedulerOutput`` into one flattened batch (token ids, positions,
slot mapping, block tables; no padding between requests), runs the model, and returns fp32 logits
for the chunks that sample, in chunk order. Chunks with one new token (decodes) are placed first
so attention can batch them; the order of the returned logits is the scheduler's.

At start-up it sizes the KV cache: an explicit ``num_kv_blocks``, or a memory budget measured
after a profiling forward pass of ``max_num_batched_tokens`` tokens.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import itertools
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from bulkinfer.engine.attention import AttentionBackend, AttentionMetadata
from bulkinfer.engine.config import EngineConfig
from bulkinfer.engine.decode_graphs import DecodeGraphs, decode_graph_mode
from bulkinfer.engine.device_step import PlaceholderInputs, SampledStep
from bulkinfer.engine.dtype_choice import DTYPES
from bulkinfer.engine.host_memory import available_memory_bytes, read_proc_kib, reset_peak_rss
from bulkinfer.engine.kv_connector.connector import KVLoad, load_blocks
from bulkinfer.engine.kv_memory import allocate_kv_caches, populate_kv_caches
from bulkinfer.engine.lora.rows import NO_ADAPTER, LoRARows
from bulkinfer.engine.models.llama import FinalRows, LlamaForCausalLM
from bulkinfer.engine.persistent_batch import BlockTables, DecodeColumns
from bulkinfer.engine.prompt_logprobs import ScoreSpan, score_rows, score_span
from bulkinfer.engine.sampler import RowLogprobs, Sampler, SamplingBatch
from bulkinfer.engine.scheduler import ScheduledChunk, SchedulerOutput

if TYPE_CHECKING:
    from bulkinfer.engine.lora.manager import LoRAManager
    from bulkinfer.engine.parallel.group import TensorParallelGroup

logger = logging.getLogger(__name__)

# CPU default: a quarter of the memory available after profiling, at most 4 GiB — a worker shares
# its box with the OS, its own activations and object-store I/O buffers.
CPU_DEFAULT_KV_FRACTION = 0.25
CPU_DEFAULT_KV_CAP_BYTES = 4 << 30
GPU_DEFAULT_KV_FRACTION = 0.9
# Layers the start-up profiling pass runs: two, so it covers a layer that takes the residual stream
# from another (the first starts it).
PROFILE_LAYERS = 2


@dataclass
class StepResult:
    """What one forward pass gives: the sampled rows' fp32 logits (in every compute dtype) and the
    prompt logprobs it scored, by request id."""

    logits: torch.Tensor
    prompt_logprobs: dict[str, list[RowLogprobs]] = field(default_factory=dict)


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

    def sampled_hidden(self, model: LlamaForCausalLM, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """Forward the batch: the final hidden states of its sampled positions, in their order."""
        model.step_rows.lora = LoRARows(self.lora_slots) if self.lora_slots is not None else None
        try:
            hidden = model(self.input_ids, self.positions, self.metadata, kv_caches,
                           final_rows=self.final_rows)
        finally:
            model.step_rows.lora = None  # other forwards (profiling, probes) run the base model
        if self.final_rows is None:
            return hidden[self.sample_rows]
        return hidden[self.final_rows.order]


class ModelRunner:
    def __init__(self, config: EngineConfig, model: LlamaForCausalLM, extra_block_bytes: int = 0) -> None:
        """`extra_block_bytes`: what else each KV block costs (a draft model's KV in the same blocks)."""
        if config.max_model_len is None:
            raise ValueError("ModelRunner needs a resolved max_model_len")
        if config.dtype not in DTYPES:
            raise ValueError(f"ModelRunner needs a resolved dtype, got {config.dtype!r}")
        self.config = config
        self.model = model
        self.device = torch.device(config.device)
        self.dtype = DTYPES[config.dtype]
        self.block_size = config.block_size
        self.extra_block_bytes = extra_block_bytes
        self.kv_caches: list[torch.Tensor] = []
        self.num_kv_blocks = 0
        # Fixed-shape decode steps (CUDA graphs on a GPU): the setting, or by default on a GPU only.
        self.use_decode_graphs, self.capture_decode_graphs = decode_graph_mode(
            self.device.type, config.decode_graphs, getattr(model, "graph_capturable", True))
        self.decode_graphs: DecodeGraphs | None = None
        # Rank 0 of a tensor-parallel engine: the other ranks, which run every forward it runs.
        self.parallel: TensorParallelGroup | None = None
        # Set by the engine with enable_lora: the adapters' slots each row's LoRA slot comes from.
        self.lora: LoRAManager | None = None
        self.tensor_parallel_size = config.tensor_parallel_size
        if self.tensor_parallel_size > 1:
            # A graph's step cannot pair its collectives with the other ranks (engine/config.py).
            self.use_decode_graphs = False
        self.sampler = Sampler()
        # Plain decode rows' block tables, kept across steps (engine/persistent_batch.py).
        self.block_tables = BlockTables(2 * config.max_num_seqs,
                                        -(-config.max_model_len // self.block_size) + 1)
        if self.device.type == "cpu":
            keep_freed_memory_for_reuse()

    # ---- KV cache sizing -------------------------------------------------------------------------

    @property
    def kv_block_bytes(self) -> int:
        """Bytes of one block across all layers (K and V)."""
        c = self.model.config
        per_layer = 2 * self.block_size * c.num_kv_heads * c.head_dim * self.dtype.itemsize
        # Tensor parallel: each rank holds its KV heads' share of a block. On CPU the ranks' caches
        # share the host's memory, so a block costs all of theirs; a GPU rank's is on its own device.
        ranks_on_this_memory = self.tensor_parallel_size if self.device.type == "cpu" else 1
        return per_layer * c.num_layers * ranks_on_this_memory + self.extra_block_bytes

    def max_useful_blocks(self) -> int:
        """Blocks that max_num_seqs requests of max_model_len could ever hold, plus the null block."""
        per_seq = math.ceil(self.config.max_model_len / self.block_size)
        return self.config.max_num_seqs * per_seq + 1

    def initialize_kv_cache(self) -> int:
        """Profile, decide the number of blocks, allocate the cache; returns the block count."""
        if self.config.num_kv_blocks is not None:
            num_blocks = self.config.num_kv_blocks
            self.profile_run()
        else:
            reset_peak_rss()
            rss_before = read_proc_kib(Path("/proc/self/status"), "VmRSS")
            self.profile_run()
            budget = self._kv_budget_bytes(rss_before)
            num_blocks = min(budget // self.kv_block_bytes, self.max_useful_blocks())
            if num_blocks < 2:
                raise RuntimeError(
                    f"KV cache budget of {budget} bytes holds {num_blocks} block(s) "
                    f"of {self.kv_block_bytes} bytes; "
                    "raise kv_cache_memory or set num_kv_blocks"
                )
        self.allocate_kv_cache(num_blocks)
        return num_blocks

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Allocate `num_blocks` blocks (on every rank) and map what the start-up time allows."""
        self._send("allocate", num_blocks)
        self._allocate(num_blocks)
        started = time.perf_counter()
        populated = populate_kv_caches(self.kv_caches, self.config.kv_populate_seconds)
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB), %d mapped at start in %.1f s",
            num_blocks,
            self.block_size,
            num_blocks * self.kv_block_bytes / 2**20,
            populated,
            time.perf_counter() - started,
        )

    def _kv_budget_bytes(self, rss_before_kib: int | None) -> int:
        setting = self.config.kv_cache_memory
        if isinstance(setting, int):
            return setting
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * (setting or GPU_DEFAULT_KV_FRACTION))
        available = available_memory_bytes()
        if available is None:
            raise RuntimeError(
                "cannot read MemAvailable from /proc/meminfo: set kv_cache_memory or num_kv_blocks"
            )
        # Keep room for the activations the profiling pass needed (peak RSS growth during it).
        peak = read_proc_kib(Path("/proc/self/status"), "VmHWM")
        activations = max(0, (peak or 0) - (rss_before_kib or 0)) * 1024
        budget = int(available * (setting or CPU_DEFAULT_KV_FRACTION)) - activations
        return min(budget, CPU_DEFAULT_KV_CAP_BYTES) if setting is None else budget

    def _allocate(self, num_blocks: int) -> None:
        self.kv_caches = allocate_kv_caches(self.model.config, num_blocks, self.block_size, self.dtype,
                                            self.device)
        self.num_kv_blocks = num_blocks

    @torch.inference_mode()
    def profile_run(self) -> None:
        """A forward pass over max_num_batched_tokens tokens (as prefills), into a throwaway cache.

        Only the first PROFILE_LAYERS layers run: the peak of activation memory is one layer's, the
        same in each, and the other 28 of SmolLM2's 30 cost an fp32 start 2.6 s for nothing."""
        self._send("profile")
        with self._collectives("the profiling pass"):
            self._profile()

    def _profile(self) -> None:
        c = self.model.config
        num_layers = min(PROFILE_LAYERS, c.num_layers)
        budget = self.config.max_num_batched_tokens
        seq_len = min(budget, self.config.max_model_len)
        query_lens = [seq_len] * (budget // seq_len) + ([budget % seq_len] if budget % seq_len else [])
        blocks_per_seq = math.ceil(seq_len / self.block_size)
        shape = (2, blocks_per_seq * len(query_lens), c.num_kv_heads, self.block_size, c.head_dim)
        caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(num_layers)]
        starts = list(itertools.accumulate(query_lens, initial=0))[:-1]
        # Built on the host, then moved: like a real step's batch.
        tables = [
            torch.arange(i * blocks_per_seq, i * blocks_per_seq + math.ceil(n / self.block_size))
            for i, n in enumerate(query_lens)
        ]
        positions = torch.cat([torch.arange(n) for n in query_lens]).to(self.device)
        slot_mapping = torch.cat(
            [
                t[torch.arange(n) // self.block_size] * self.block_size + torch.arange(n) % self.block_size
                for t, n in zip(tables, query_lens, strict=True)
            ]
        ).to(self.device)
        tables = [t.to(self.device) for t in tables]
        metadata = AttentionMetadata(
            block_size=self.block_size,
            slot_mapping=slot_mapping,
            num_decodes=0,
            decode_seq_lens=torch.empty(0, dtype=torch.long),
            decode_block_tables=torch.empty(0, 1, dtype=torch.long),
            prefill_query_starts=starts,
            prefill_query_lens=query_lens,
            prefill_seq_lens=query_lens,
            prefill_block_tables=tables,
        )
        input_ids = torch.zeros(budget, dtype=torch.long, device=self.device)
        hidden = self.model(input_ids, positions, metadata, caches, num_layers=num_layers)
        last_rows = torch.tensor(
            [s + n - 1 for s, n in zip(starts, query_lens, strict=True)], device=self.device
        )
        self.model.compute_logits(hidden[last_rows])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- timing probes (speculative decoding's cost curve) --------------------------------------------

    def can_probe(self, num_drafts: int, context: int = 64) -> bool:
        """Whether the KV pool holds one probe sequence (probe rows share its blocks)."""
        return self.num_kv_blocks - 1 >= -(-(context + 1 + num_drafts) // self.block_size)

    @torch.inference_mode()
    def probe_forward(self, batch: int, tokens_per_row: int, context: int) -> None:
        """A forward of `batch` requests of `tokens_per_row` new tokens after `context` cached ones,
        with logits at every new position, as decode or verification steps have: each new position
        a solo decode row, as ``prepare_batch`` lays out verification. The rows share blocks 1.. of
        the pool: run it only while no request holds blocks (start-up); the garbage KV it writes is
        overwritten before any request reads those slots."""
        self._send("probe", batch, tokens_per_row, context)
        blocks = list(range(1, 1 + -(-(context + tokens_per_row) // self.block_size)))
        rows = [BatchRow([0], context + j, blocks, 1, solo=tokens_per_row > 1)
                for _ in range(batch) for j in range(tokens_per_row)]
        step = prepare_rows(rows, self.block_size, self.device)
        assert step is not None
        with self._collectives("a timing probe"):
            self.model.compute_logits(step.sampled_hidden(self.model, self.kv_caches))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- one step ----------------------------------------------------------------------------------

    def execute(self, output: SchedulerOutput) -> torch.Tensor:
        """Forward the scheduled chunks; logits [sampled positions, vocab] in chunk order (one row
        per sampling chunk, 1 + drafts for a chunk verifying drafts), in fp32."""
        return self.run_step(output).logits

    @torch.inference_mode()
    def run_step(self, output: SchedulerOutput) -> StepResult:
        """`execute`, plus the prompt logprobs of the chunks that ask for them, from the same pass."""
        return self.forward_prepared(self.prepare_step(output))

    def prepare_step(self, output: SchedulerOutput) -> PreparedStep:
        """Host work of a step: its rows flattened into input tensors (on the device). Plain decode
        rows go through the persistent block tables, except where the other tensor-parallel ranks
        need every row as an object or adapters order the rows."""
        columns = self.parallel is None and self.lora is None
        step = self.batch_rows_with_placeholders(output, columns=columns)
        batch = prepare_rows(step.rows, self.block_size, self.device, step.decodes, step.units,
                             self.block_tables if columns else None)
        filled = None
        if batch is not None:
            batch.score_spans = step.spans
            places = step.column_placeholders + [(batch.row_ends[i] - 1, r) for i, r in step.placeholders]
            if places:
                filled = PlaceholderInputs([flat for flat, _ in places], [r for _, r in places])
        return PreparedStep(batch, step.rows, output.kv_loads, filled)

    @torch.inference_mode()
    def forward_prepared(self, prepared: PreparedStep, previous: SampledStep | None = None) -> StepResult:
        """Device work of a step: the fetched prefix blocks copied in, placeholder inputs filled
        from the previous step's sampled ids, the forward pass."""
        if prepared.kv_loads:
            load_blocks(self.kv_caches, prepared.kv_loads)
        batch = prepared.batch
        if batch is None:
            return StepResult(torch.empty(0, self.model.config.vocab_size, dtype=torch.float32,
                                          device=self.device))
        if prepared.placeholders is not None:
            assert previous is not None, "placeholder inputs need the previous step's sampled ids"
            prepared.placeholders.fill(batch.input_ids, previous)
        self._send("step", prepared.rows)
        with self._collectives("a step"):
            return self.forward_batch(batch)

    @torch.inference_mode()
    def sample_step(self, prepared: PreparedStep, batch: SamplingBatch, sampled_rows: Sequence[str],
                previous: SampledStep | None = None) -> SampledStep:
        """Forward a prepared step and sample its rows on the device: only the sampled ids (and
        logprobs where asked) come back to the host."""
        result = self.forward_prepared(prepared, previous)
        batch.resolve_bitmask()  # async scheduling: the forward pass ran while the host filled it
        if previous is not None:
            batch.fill_placeholders(previous.device_token_ids, previous.row_of_request)
        if not batch.num_rows:
            return SampledStep([], [], prompt_logprobs=result.prompt_logprobs)
        sampled = self.sampler.sample(result.logits, batch)
        return SampledStep(sampled.token_ids, sampled.logprobs, sampled.invalid_rows, result.prompt_logprobs,
                           device_token_ids=sampled.device_token_ids,
                           row_of_request={request_id: i for i, request_id in enumerate(sampled_rows)})

    @torch.inference_mode()
    def forward_rows(self, rows: list[BatchRow]) -> None:
        """Another rank's share of rank 0's step over `rows` (its outputs stay with rank 0)."""
        batch = prepare_rows(rows, self.block_size, self.device)
        assert batch is not None
        self.forward_batch(batch)

    def forward_batch(self, batch: StepBatch) -> StepResult:
        """The sampled rows' logits of a prepared batch, and its scored prompt positions'."""
        # Graphs hold no LoRA update: a step with adapter rows runs eagerly.
        graphs = self._decode_graphs() if not batch.num_scored and batch.lora_slots is None else None
        if graphs is not None:
            logits = graphs.run(batch.input_ids, batch.positions, batch.metadata, batch.sample_rows)
            if logits is not None:
                return StepResult(logits)
        hidden = batch.sampled_hidden(self.model, self.kv_caches)
        num_sampled = len(hidden) - batch.num_scored
        logits = self.model.compute_logits(hidden[:num_sampled])
        if not batch.num_scored:
            return StepResult(logits)
        scored = score_rows(self._score_head(), hidden[num_sampled:], batch.score_spans, batch.num_scored,
                            self.model.final_logit_softcap)
        return StepResult(logits, scored)

    def _score_head(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """fp32 logits of hidden rows over the whole vocabulary, for prompt logprobs: the LM head
        the sampled rows take, before any soft-capping (score_rows applies it)."""
        return self.model.lm_head.forward_fp32

    # ---- tensor parallel (rank 0) ------------------------------------------------------------------

    def _send(self, *message: object) -> None:
        if self.parallel is not None:
            self.parallel.send(*message)

    @contextmanager
    def _collectives(self, what: str) -> Iterator[None]:
        """A collective that fails (a rank died) fails the engine with the rank's own story."""
        if self.parallel is None:
            yield
            return
        from bulkinfer.engine.parallel.communicator import CollectiveError

        try:
            yield
        except CollectiveError as error:
            raise self.parallel.fail(f"{what} failed ({error})") from None

    def _decode_graphs(self) -> DecodeGraphs | None:
        """The fixed-shape decode path, where the config (or, by default, a GPU) asks for it;
        built once the KV cache exists."""
        if not self.use_decode_graphs or not self.kv_caches:
            return None
        if self.decode_graphs is None:
            assert self.config.max_model_len is not None
            self.decode_graphs = DecodeGraphs(self.model, self.kv_caches, self.block_size,
                                              self.config.max_model_len, self.config.max_num_seqs,
                                              capture=self.capture_decode_graphs,
                                              gathers_kv=attention_gathers_kv(self.model))
        return self.decode_graphs

    def prepare_batch(self, output: SchedulerOutput) -> StepBatch | None:
        """Flatten a SchedulerOutput: decodes (one new token) first, then prefill chunks."""
        rows, spans = self.batch_rows(output)
        batch = prepare_rows(rows, self.block_size, self.device)
        if batch is not None:
            batch.score_spans = spans
        return batch

    def batch_rows(self, output: SchedulerOutput) -> tuple[list[BatchRow], list[ScoreSpan]]:
        """A SchedulerOutput's rows (what ``prepare_rows`` flattens) and its scored prompt spans."""
        step = self.batch_rows_with_placeholders(output)
        return step.rows, step.spans

    def batch_rows_with_placeholders(self, output: SchedulerOutput, columns: bool = False) -> StepRows:
        """A SchedulerOutput's rows (what ``prepare_rows`` flattens), its scored prompt spans, and
        the rows whose last input token is a placeholder: a token the step still in flight is
        sampling (async scheduling), written as 0 here and filled on the device. With `columns`,
        plain decode rows go into `StepRows.decodes` instead (the persistent batch).

        A chunk that verifies drafts (its last known token, then k drafts) becomes 1 + k solo decode
        rows over the same block table, each attending up to its own position: every position is
        computed as decoding it alone is (the decode kernel, not the prefill one; not grouped over
        the shared blocks), so in bf16 too verification gives the logits a lone decode gets.
        """
        step = StepRows(decodes=DecodeColumns() if columns else None, units=[] if columns else None)
        rows, decodes, units = step.rows, step.decodes, step.units
        if self.lora is not None:
            self.lora.begin_step()
        invariant = self.config.batch_invariant_on
        for chunk in output.chunks:
            request = chunk.request
            if decodes is not None and chunk.num_new_tokens == 1 and not chunk.spec_token_ids \
                    and (not invariant or chunk.start >= request.num_prompt_tokens) \
                    and not request.needs_prompt_logprobs:
                assert units is not None
                known = chunk.start < len(request.all_token_ids)
                if not known:
                    step.column_placeholders.append((len(decodes), request.request_id))
                units.append(len(decodes))
                decodes.add(request.request_id, chunk.block_ids, chunk.start,
                            request.all_token_ids[chunk.start] if known else 0, chunk.samples)
                continue
            first_row = len(rows)
            lora = self.lora.slot_of(request.lora_request) if self.lora is not None else NO_ADAPTER
            if chunk.spec_token_ids:
                tokens = [request.all_token_ids[chunk.start], *chunk.spec_token_ids]
                rows.extend(BatchRow([token], chunk.start + j, chunk.block_ids, 1, solo=True, lora_slot=lora)
                            for j, token in enumerate(tokens))
            else:
                end = chunk.start + chunk.num_new_tokens
                span = score_span(chunk)
                if span is not None:
                    step.spans.append(span)
                if invariant:
                    rows.extend(invariant_rows(chunk, lora, (span.offset, span.count) if span else None))
                else:
                    rows.append(BatchRow(known_tokens(request.all_token_ids, chunk.start, end), chunk.start,
                                         chunk.block_ids, chunk.num_sample_rows,
                                         score=(span.offset, span.count) if span else None, lora_slot=lora))
                if end > request.num_tokens:
                    step.placeholders.append((len(rows) - 1, request.request_id))
            if units is not None:
                units.extend(~r for r in range(first_row, len(rows)))
        return step


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
    solo = torch.tensor([False] * num_columns + row_solo, dtype=torch.bool) if any(row_solo) else None
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


def attention_gathers_kv(model: torch.nn.Module) -> bool:
    """Whether the model's attention backend copies K/V out of the cache in a fixed-shape step."""
    backend = next((module.backend for module in model.modules()
                    if isinstance(getattr(module, "backend", None), AttentionBackend)), None)
    return True if backend is None else backend.gathers_kv


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


# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_freed_memory_for_reuse() -> bool:
    """Make glibc keep freed activation buffers (tens of MB) in the heap instead of unmapping them.

    By default each step's large temporaries are mmap'ed and unmapped again, and the fresh pages
    fault in on every step: measured 50-100k page faults and ~17% of a 2048-token prefill step on
    our CPUs, none after this. Process-wide, but the engine owns its worker process; a no-op
    without glibc. Returns whether it applied.
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):
        return False
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, 256 << 20)) and bool(mallopt(_M_TRIM_THRESHOLD, 1 << 30))
