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
from typing import TYPE_CHECKING, cast

import torch

from bulkinfer.engine.attention import AttentionBackend, AttentionMetadata
from bulkinfer.engine.config import EngineConfig
from bulkinfer.engine.decode_graphs import DecodeGraphs, decode_graph_mode
from bulkinfer.engine.device_step import PlaceholderInputs, SampledStep
from bulkinfer.engine.dtype_choice import DTYPES
from bulkinfer.engine.host_memory import available_memory_bytes, read_proc_kib, reset_peak_rss
from bulkinfer.engine.kv_connector.connector import load_blocks
from bulkinfer.engine.kv_memory import allocate_kv_caches, populate_kv_caches
from bulkinfer.engine.lora.rows import NO_ADAPTER
from bulkinfer.engine.mixed_graphs import MixedGraphs
from bulkinfer.engine.models.llama import LlamaForCausalLM
from bulkinfer.engine.multimodal.encoder_cache import EncoderCache
from bulkinfer.engine.multimodal.rope_steps import shifted_positions
from bulkinfer.engine.multimodal.step_embeds import (
    ImageChunk,
    ImageEncoder,
    StepImageEmbeds,
    step_image_embeds,
)
from bulkinfer.engine.persistent_batch import BlockTables, DecodeColumns
from bulkinfer.engine.prompt_logprobs import ScoreSpan, score_rows, score_span
from bulkinfer.engine.sampler import RowLogprobs, Sampler, SamplingBatch
from bulkinfer.engine.scheduler import ScheduledChunk, SchedulerOutput
from bulkinfer.engine.step_batch import (
    BatchRow,
    PreparedStep,
    StepBatch,
    StepRows,
    invariant_rows,
    known_tokens,
    prepare_rows,
)

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


class ModelRunner:
    def __init__(self, config: EngineConfig, model: LlamaForCausalLM, extra_block_bytes: int = 0) -> None:
        """`extra_block_bytes`: what else each KV block costs (a draft model's KV in the same blocks)."""
        if config.max_model_len is None:
            raise ValueError("ModelRunner needs a resolved max_model_len")
        if config.dtype not in DTYPES:
            raise ValueError(f"ModelRunner needs a resolved dtype, got {config.dtype!r}")
        self.config = config
        self.max_model_len: int = config.max_model_len  # resolved (checked above)
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
        self.mixed_graphs: MixedGraphs | None = None
        self.mixed_graphs_apply: bool | None = None  # whether they can (None: not decided yet)
        # Rank 0 of a tensor-parallel engine: the other ranks, which run every forward it runs.
        self.parallel: TensorParallelGroup | None = None
        # Set by the engine with enable_lora: the adapters' slots each row's LoRA slot comes from.
        self.lora: LoRAManager | None = None
        # Set by the engine for a model that takes images: encoder outputs by image digest.
        self.encoder_cache: EncoderCache | None = None
        # M-RoPE (Qwen2.5-VL): a step's positions follow its requests' position tables, not token indices.
        self.uses_mrope = bool(getattr(model.config, "mrope_section", ()))
        # Under tensor parallel every rank builds the same step from the same rows, so each takes the
        # same padded shape (graph or eager) in the same order: their collectives pair up.
        self.tensor_parallel_size = config.tensor_parallel_size
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
        per_seq = math.ceil(self.max_model_len / self.block_size)
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
        seq_len = min(budget, self.max_model_len)
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
        if batch is not None and step.image_rows:
            batch.image_embeds = self._image_embeds(step, batch)
        if batch is not None and self.uses_mrope:
            shifted_positions(batch, step, output)
        if batch is not None:
            batch.score_spans = step.spans
            places = step.column_placeholders + [(batch.row_ends[i] - 1, r) for i, r in step.placeholders]
            if places:
                filled = PlaceholderInputs([flat for flat, _ in places], [r for _, r in places])
        return PreparedStep(batch, step.rows, output.kv_loads, filled)

    def _image_embeds(self, step: StepRows, batch: StepBatch) -> StepImageEmbeds | None:
        """The encoder rows of the step's image tokens, at their flat positions."""
        assert self.encoder_cache is not None, "image rows on a model without an image encoder"
        chunks = [ImageChunk(items, start, end, batch.row_ends[row] - len(step.rows[row].token_ids))
                  for row, items, start, end in step.image_rows]
        encoder = cast(ImageEncoder, self.model)  # a vision-language model (it has an encoder cache)
        return step_image_embeds(chunks, encoder, self.encoder_cache, self.device)

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
        fills = None
        if prepared.placeholders is not None:
            assert previous is not None, "placeholder inputs need the previous step's sampled ids"
            prepared.placeholders.fill(batch.input_ids, previous)
            if self.parallel is not None:  # the other ranks take the same tokens, from the host
                fills = (prepared.placeholders.flat_index, prepared.placeholders.values(previous))
        self._send("step", prepared.rows, fills)
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
            batch.fill_placeholders(previous)
        if not batch.num_rows:
            return SampledStep([], [], prompt_logprobs=result.prompt_logprobs)
        sampled = self.sampler.sample(result.logits, batch)
        return SampledStep(sampled.token_ids, sampled.logprobs, sampled.invalid_rows, result.prompt_logprobs,
                           device_token_ids=sampled.device_token_ids,
                           row_ids=sampled_rows)

    @torch.inference_mode()
    def forward_rows(self, rows: list[BatchRow], fills: tuple[list[int], list[int]] | None = None) -> None:
        """Another rank's share of rank 0's step over `rows` (its outputs stay with rank 0); `fills`:
        (flat index, token) of the inputs rank 0 filled from its previous step's sampled ids."""
        batch = prepare_rows(rows, self.block_size, self.device)
        assert batch is not None
        if fills is not None:
            index, tokens = fills
            batch.input_ids[torch.tensor(index, device=self.device)] = torch.tensor(
                tokens, dtype=batch.input_ids.dtype, device=self.device)
        self.forward_batch(batch)

    def forward_batch(self, batch: StepBatch) -> StepResult:
        """The sampled rows' logits of a prepared batch, and its scored prompt positions'."""
        # Graphs hold no LoRA update: a step with adapter rows runs eagerly.
        graphs = self._decode_graphs() if not batch.num_scored and batch.lora_slots is None \
            and batch.image_embeds is None and batch.rope_rows is None else None
        if graphs is not None:
            logits = graphs.run(batch.input_ids, batch.positions, batch.metadata, batch.sample_rows)
            mixed = self._mixed_graphs() if logits is None else None
            if mixed is not None:
                logits = mixed.run(batch.input_ids, batch.positions, batch.metadata, batch.sample_rows)
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
            self.decode_graphs.strict = self.tensor_parallel_size > 1
        return self.decode_graphs

    def _mixed_graphs(self) -> MixedGraphs | None:
        """The fixed-shape path of steps with prefill chunks, beside the decode graphs: where the
        attention reads its whole layout from the device (the Triton kernels) and rows need not
        keep their bits across batches (batch invariance splits rows by a host count)."""
        if self.mixed_graphs_apply is None and self.kv_caches:
            # Decided once: the backend and batch invariance do not change while the engine runs.
            self.mixed_graphs_apply = (not self.config.batch_invariant_on
                                       and not attention_gathers_kv(self.model))
        if self.mixed_graphs is None and self.mixed_graphs_apply:
            assert self.config.max_model_len is not None
            self.mixed_graphs = MixedGraphs(self.model, self.kv_caches, self.block_size,
                                            self.config.max_model_len, self.config.max_num_seqs,
                                            self.config.max_num_batched_tokens,
                                            capture=self.capture_decode_graphs)
            self.mixed_graphs.strict = self.tensor_parallel_size > 1
        return self.mixed_graphs

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
            if decodes is not None and chunk.spec_token_ids and chunk.samples:
                # Verifying drafts: 1 + k solo columns over the request's table, the first a
                # placeholder where the step in flight is still sampling it.
                assert units is not None
                tokens, known = verified_tokens(chunk)
                if not known:
                    step.column_placeholders.append((len(decodes), request.request_id))
                for j, token in enumerate(tokens):
                    units.append(len(decodes))
                    decodes.add(request.request_id, chunk.block_ids, chunk.start + j, token, True, solo=True)
                continue
            in_prompt = chunk.start < request.num_prompt_tokens
            if decodes is not None and chunk.num_new_tokens == 1 and not chunk.spec_token_ids \
                    and (not (invariant or request.mm_items) or not in_prompt) \
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
                tokens, known = verified_tokens(chunk)
                if not known:
                    step.placeholders.append((first_row, request.request_id))
                rows.extend(BatchRow([token], chunk.start + j, chunk.block_ids, 1, solo=True, lora_slot=lora)
                            for j, token in enumerate(tokens))
            else:
                end = chunk.start + chunk.num_new_tokens
                span = score_span(chunk)
                if span is not None:
                    step.spans.append(span)
                if request.mm_items and in_prompt:  # its first row starts at chunk.start in every case
                    step.image_rows.append((len(rows), request.mm_items, chunk.start, end))
                if invariant:
                    rows.extend(invariant_rows(chunk, lora, (span.offset, span.count) if span else None))
                else:
                    rows.append(BatchRow(known_tokens(request.all_token_ids, chunk.start, end), chunk.start,
                                         chunk.block_ids, chunk.num_sample_rows,
                                         score=(span.offset, span.count) if span else None, lora_slot=lora))
                if end > request.num_tokens:
                    step.placeholders.append((len(rows) - 1, request.request_id))
            if request.rope_positions is not None:
                step.rope_rows.extend((r, request) for r in range(first_row, len(rows)))
            if units is not None:
                units.extend(~r for r in range(first_row, len(rows)))
        return step


def verified_tokens(chunk: ScheduledChunk) -> tuple[list[int], bool]:
    """A chunk verifying drafts: its input tokens (the last token, then the drafts) and whether that
    last token is known; a 0 stands in for it where the step in flight is still sampling it."""
    tokens = chunk.request.all_token_ids
    known = chunk.start < len(tokens)
    return [tokens[chunk.start] if known else 0, *chunk.spec_token_ids], known


def attention_gathers_kv(model: torch.nn.Module) -> bool:
    """Whether the model's attention backend copies K/V out of the cache in a fixed-shape step."""
    found = (getattr(module, "backend", None) for module in model.modules())
    backend = next((b for b in found if isinstance(b, AttentionBackend)), None)
    return True if backend is None else backend.gathers_kv


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
