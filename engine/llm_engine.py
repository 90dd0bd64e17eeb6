"""LLMEngine: requests in, finished outputs out; one ``step()`` = schedule -> forward -> sample -> update."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from bulkinfer.engine import cpu_kernels
from bulkinfer.engine.config import EngineConfig
from bulkinfer.engine.detokenizer import IncrementalDetokenizer
from bulkinfer.engine.device_step import SampledStep, StepDevice, StepQueue, resolve_async_scheduling
from bulkinfer.engine.dtype_choice import DtypeChoice, checkpoint_dtype, resolve_dtype
from bulkinfer.engine.errors import ErrorKind, SamplingParamsError
from bulkinfer.engine.gpu_kernels.choice import (
    build_attention_backend,
    use_triton_kernels,
    use_triton_layer_ops,
)
from bulkinfer.engine.grammar_tracking import GrammarTracker
from bulkinfer.engine.invariant.cuda_settings import use_invariant_cuda_settings
from bulkinfer.engine.kv_cache_manager import droppable_window
from bulkinfer.engine.kv_connector.connector import KVConnector
from bulkinfer.engine.kv_connector.model_identity import model_identity
from bulkinfer.engine.kv_connector.setup import build_connector
from bulkinfer.engine.kv_connector.stats import empty_stats
from bulkinfer.engine.lora.manager import LoRAManager
from bulkinfer.engine.lora.request import LoRARequest
from bulkinfer.engine.lora.weights import LoadedAdapter
from bulkinfer.engine.metrics import EngineCounters
from bulkinfer.engine.model_runner import ModelRunner
from bulkinfer.engine.models.loader import (
    checkpoint_quantization,
    eos_token_ids,
    load_model,
    model_config_from_dir,
)
from bulkinfer.engine.multimodal.engine_images import ImageInputs, no_images
from bulkinfer.engine.multimodal.images import ImageError, ImageLike
from bulkinfer.engine.multimodal.inputs import NO_IMAGES, MultiModalPrompt
from bulkinfer.engine.output_assembly import (
    OutputAssembler,
    Parent,
    Sample,
    parent_output,
    rejection_output,
    text_includes_last_token,
)
from bulkinfer.engine.outputs import CompletionOutput, PositionLogprobs, RequestOutput, TokenLogprob
from bulkinfer.engine.parallel.start import load_rank_model, start_group
from bulkinfer.engine.request import FinishReason, Request
from bulkinfer.engine.sampler import RowLogprobs, SamplingBatch
from bulkinfer.engine.sampling_params import SamplingParams
from bulkinfer.engine.sampling_random import SEED_MASK
from bulkinfer.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from bulkinfer.engine.speculative.config import SpeculativeConfig
from bulkinfer.engine.speculative.draft_model import DraftModel
from bulkinfer.engine.speculative.gate import SpeculationGate, cost_curve_or_none
from bulkinfer.engine.speculative.speculator import Speculator
from bulkinfer.engine.speculative.stats import add_outcome
from bulkinfer.engine.speculative.verify import accepted_tokens, sampled_positions
from bulkinfer.quant_scheme import CheckpointQuantization

logger = logging.getLogger(__name__)

__all__ = [
    "CompletionOutput",
    "LLMEngine",
    "PositionLogprobs",
    "RequestOutput",
    "TokenLogprob",
]

# n > 1: child i of request "r" runs in the scheduler as "r" + CHILD_SEPARATOR + "i".
CHILD_SEPARATOR = "\x1fn"


# How long a step with nothing to run but grammars still compiling sleeps.
GRAMMAR_WAIT_S = 0.002
NON_FINITE_LOGITS = "the model produced non-finite logits (NaN or inf) for this request; no token was emitted"


def refuse_with_quantized_weights(config: EngineConfig, quantization: CheckpointQuantization | None) -> None:
    """What a quantized checkpoint does not run with yet, refused by name before loading."""
    if quantization is None:
        return
    what = f"{config.model} is quantized ({', '.join(quantization.schemes)})"
    if config.tensor_parallel_size > 1:
        raise ValueError(f"{what}: tensor parallel runs unquantized checkpoints only "
                         "(tensor_parallel_size 1)")
    if config.enable_lora:
        raise ValueError(f"{what}: LoRA adapters run over unquantized base models only (enable_lora false)")


class LLMEngine:
    """Loads the model and tokenizer from ``config.model``, sizes the KV cache, serves requests.

    Bad input never raises from ``add_request`` (except a duplicate live request id, a caller
    bug): the request comes back from the next ``step()`` finished with ``finish_reason="error"``
    and ``error`` saying why, while the other requests keep running.
    """

    def __init__(self, config: EngineConfig) -> None:
        from transformers import AutoTokenizer  # tokenizer only; the model is our own

        config.validate()
        model_config = model_config_from_dir(config.model)
        quantization = checkpoint_quantization(config.model)
        refuse_with_quantized_weights(config, quantization)
        # The checkpoint's quantization scheme in words (None: unquantized), for manifests and logs.
        self.quantization: str | None = quantization.description if quantization is not None else None
        self.dtype_choice: DtypeChoice = resolve_dtype(
            config.dtype, config.device, checkpoint_dtype(config.model), verdicts=config.dtype_verdicts,
            remeasure=config.remeasure_dtype,
        )
        logger.info("dtype %s (%s)", self.dtype_choice.dtype, self.dtype_choice.reason)
        config = dataclasses.replace(config, dtype=self.dtype_choice.dtype)
        max_len = model_config.max_position_embeddings
        if config.max_model_len is None:
            config = dataclasses.replace(config, max_model_len=max_len)
        elif config.max_model_len > max_len:
            raise ValueError(
                f"max_model_len={config.max_model_len} exceeds the model's max_position_embeddings={max_len}"
            )
        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(config.model)
        self.uses_triton = use_triton_kernels(config.triton_kernels, torch.device(config.device).type)
        kernels = cpu_kernels.load() if config.device == "cpu" and not self.uses_triton else None
        # Tensor parallel: the other ranks start loading while this one loads its own part.
        self.parallel = start_group(config, model_config)
        try:
            spec_config, draft, num_blocks = self._load_model(config, model_config, kernels)
        except BaseException:
            if self.parallel is not None:
                self.parallel.shutdown()  # now, not when the half-built engine is collected
            raise
        self._speculator = None
        if spec_config is not None:
            curve = cost_curve_or_none(spec_config, self.runner.probe_forward, config.max_num_seqs,
                                       self.runner.can_probe(spec_config.num_speculative_tokens))
            self._speculator = Speculator(spec_config, SpeculationGate(spec_config, curve), draft)
        self.lora: LoRAManager | None = None
        if config.enable_lora:
            self.lora = LoRAManager(self.model, config.max_loras, config.max_lora_rank,
                                    config.max_cpu_loras or config.max_loras, self.dtype_choice.torch_dtype,
                                    torch.device(config.device))
            self.runner.lora = self.lora
        self.eos_token_ids = eos_token_ids(config.model, self.tokenizer, model_config.eos_token_ids)
        self.eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None  # the primary one
        # Blocks behind the window are freed only where every layer (the draft's too: it reads the
        # same block tables) attends within one.
        window = droppable_window(model_config.sliding_windows,
                                  *([draft.config.sliding_windows] if draft is not None else []))
        # Prefix KV in a store: block hashes name the weights, not the folder, so workers share.
        model_key = model_identity(config.model) if config.kv_store is not None else None
        self.scheduler = Scheduler(config, num_blocks, self.eos_token_ids, sliding_window=window,
                                   model_key=model_key)
        self.kv_connector: KVConnector | None = None
        if model_key is not None:
            self.kv_connector = build_connector(config, model_key, self.model.config,
                                                self.dtype_choice.torch_dtype, self.runner.kv_caches)
            self.scheduler.kv_connector = self.kv_connector
            self.scheduler.kv_cache_manager.block_observer = self.kv_connector.offer
        # Structured output: grammars of live samples; xgrammar is imported on the first such request.
        self._grammars = GrammarTracker(self.tokenizer, model_config.vocab_size, config.max_num_seqs)
        self.scheduler.can_admit = self._grammars.can_admit
        # The device side of a step: the model runner, or a stand-in (benchmarks/host_bench.py).
        self.device: StepDevice = self.runner
        self.async_scheduling = resolve_async_scheduling(config)
        self._step_queue = StepQueue() if self.async_scheduling else None
        if self.lora is not None:
            self.lora.keep_in_flight_slots = self.async_scheduling  # the step in flight still reads its slots
        self._in_flight: _Step | None = None  # the launched step whose outputs are not taken yet
        self._last_applied = 0.0  # when the last step's outputs were taken (time.monotonic())
        self._saving: concurrent.futures.Future[None] | None = None  # KV store copies on the step thread
        # Seeds of unseeded requests: reproducible per engine run (config.seed), not per request.
        self._seed_rng = random.Random(config.seed)
        self.counters = EngineCounters()
        self._vocab_size = model_config.vocab_size
        self._parents: dict[str, Parent] = {}
        self._samples: dict[str, Sample] = {}  # by scheduler request id
        # Samples that need per-token work after sampling (stop strings, grammar, logprobs).
        self._post_ids: set[str] = set()
        self._penalty_ids: set[str] = set()  # live samples with penalties (drafts cannot run ahead of them)
        self._assembler = OutputAssembler(self.tokenizer)
        self._pending: list[RequestOutput] = []  # rejected / aborted, reported by the next step()
        # A model that takes images: its processor and encoder cache (None: text only).
        self.images = ImageInputs.for_model(config.model, self.tokenizer)
        if self.images is not None:
            if self.parallel is not None:
                raise ValueError("a vision-language model runs on one rank (tensor_parallel_size 1)")
            self.runner.encoder_cache = self.scheduler.encoder_cache = self.images.cache

    def _load_model(self, config: EngineConfig, model_config: Any,
                    kernels: Any) -> tuple[SpeculativeConfig | None, DraftModel | None, int]:
        """Load the model (this rank's part of it, with tensor parallel), a draft model where
        speculative decoding asks for one, and size the KV cache; returns (speculative config,
        draft, number of KV blocks)."""
        attention = build_attention_backend(self.uses_triton, kernels, config.batch_invariant_on)
        if config.batch_invariant_on and config.device.startswith("cuda"):
            use_invariant_cuda_settings()  # before the model's first GEMM makes cuBLAS's handle
        if self.parallel is None:
            self.model = load_model(
                config.model,
                attention,
                dtype=self.dtype_choice.torch_dtype,
                device=config.device,
                # Most FLOPs run in full steps (prefill chunks), so pack the weights for that size.
                batch_hint=config.max_num_batched_tokens,
            )
        else:
            self.model = load_rank_model(config.model, attention,
                                         self.parallel.communicator, dtype=self.dtype_choice.torch_dtype,
                                         device=self.parallel.device,
                                         batch_hint=config.max_num_batched_tokens)
        self.model.use_cpu_kernels(kernels)
        use_triton_layer_ops(self.model, self.uses_triton)
        if hasattr(self.model, "use_batch_invariance"):
            self.model.use_batch_invariance(config.batch_invariant_on)
        spec_config = SpeculativeConfig.from_value(config.speculative_config)
        draft = None
        if spec_config is not None and spec_config.method == "draft_model":
            assert config.max_model_len is not None  # resolved from the model above
            draft = DraftModel(str(spec_config.model), target_vocab_size=model_config.vocab_size,
                               max_model_len=config.max_model_len, dtype=self.dtype_choice.torch_dtype,
                               device=config.device, block_size=config.block_size, kernels=kernels,
                               attention=build_attention_backend(self.uses_triton, kernels, False))
        # A draft model's KV shares the target's blocks, so each block holds both.
        self.runner = ModelRunner(config, self.model, extra_block_bytes=draft.block_bytes if draft else 0)
        if self.parallel is not None:
            self.parallel.wait_ready()
            self.runner.parallel = self.parallel
        num_blocks = self.runner.initialize_kv_cache()
        if draft is not None:
            draft.allocate(num_blocks)
        return spec_config, draft, num_blocks

    # ---- requests ------------------------------------------------------------------------------

    def process_prompt(self, prompt: str | Sequence[int], images: Sequence[ImageLike],
                       details: Sequence[str | None] | None = None) -> MultiModalPrompt:
        """A prompt with its images (one placeholder token each, as the chat template writes it)
        expanded for the model: what `add_request` takes. Safe to call from any thread (image decoding
        and resizing then stay off the engine's loop); raises ImageError naming the problem."""
        if self.images is None:
            raise no_images(self.config.model)
        token_ids, error = self._tokenize(prompt)
        if error is not None:
            raise ImageError(error)
        return self.images.prompt(token_ids, images, details)

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int] | MultiModalPrompt,
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        images: Sequence[ImageLike] | None = None,
    ) -> None:
        """Queue a request. ``arrival_time`` is ``time.monotonic()`` seconds (default: now).
        ``cache_salt``: the request reuses (and leaves) prefix-cache blocks only for requests with
        the same salt, so one user's prompts neither hit nor reveal another's (None: unsalted).
        ``lora_request``: the adapter it runs with (None: the base model); an adapter that cannot
        be served raises LoRAAdapterError, and any adapter on an engine without ``enable_lora``
        ValueError. ``images``: the prompt's images (PIL images, bytes, paths or data: URLs), one per
        placeholder; or pass a prompt from ``process_prompt``. A bad image fails the request alone."""
        if request_id in self._parents:
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        lora_digest = self.load_lora(lora_request).digest if lora_request is not None else None
        params = params if params is not None else SamplingParams()
        prompt_text = prompt if isinstance(prompt, str) else None
        image_problem = None
        if images:
            try:
                prompt = self.process_prompt(prompt, images)  # type: ignore[arg-type]
            except ImageError as image_error:
                prompt, image_problem = [], str(image_error)
        multimodal = prompt if isinstance(prompt, MultiModalPrompt) else NO_IMAGES
        if isinstance(prompt, MultiModalPrompt):
            prompt = prompt.token_ids
        token_ids, error = self._tokenize(prompt)
        kind = ErrorKind.INVALID_PROMPT if error is not None else None
        if image_problem is not None:
            kind, error = ErrorKind.INVALID_IMAGE, image_problem
        arrival = time.monotonic() if arrival_time is None else arrival_time
        params_error = _params_error(params)  # the one place SamplingParams are validated
        if error is None and params_error is not None:
            kind, error = params_error
        spec = None
        if error is None:
            spec, error = self._grammars.spec(params)
            kind = ErrorKind.STRUCTURED_OUTPUT if error is not None else None
        n = params.n if params_error is None else 1  # outputs to report, even for a rejection
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(64)
        children = [
            Request(
                request_id=request_id if n == 1 else f"{request_id}{CHILD_SEPARATOR}{i}",
                prompt_token_ids=token_ids,
                sampling_params=params,
                arrival_time=arrival,
                priority=priority,
                cache_salt=cache_salt,
                sample_seed=seed & SEED_MASK,
                sample_index=i,
                lora_request=lora_request,
                lora_digest=lora_digest,
                mm_items=multimodal.items,
                rope_positions=multimodal.rope_positions,
                rope_delta=multimodal.rope_delta,
            )
            for i in range(n if error is None else 1)
        ]
        parent = Parent(request_id, prompt_text, list(token_ids), children,
                        prompt_logprobs=[] if params.prompt_logprobs is not None and error is None else None,
                        lora_name=lora_request.lora_name if lora_request is not None else None)
        if error is not None:
            children[0].finish(FinishReason.ERROR, time.monotonic(), error=error, kind=kind)
            self._reject(parent, n)
            return
        for child in children:
            if not self.scheduler.add_request(child):  # rejected: every child would be too
                for queued in children:
                    if queued is not child:
                        self.scheduler.abort_request(queued.request_id)
                parent.children = [child]
                self._reject(parent, n)
                return
        self._parents[request_id] = parent
        for child in children:
            sample = Sample(
                parent=parent,
                request=child,
                detokenizer=self._detokenizer(child) if params.stop else None,
                logprobs=[] if params.logprobs is not None else None,
                structured=spec is not None,
            )
            self._samples[child.request_id] = sample
            if lora_request is not None and self.lora is not None:
                self.lora.acquire(lora_request)  # kept in host memory until the sample ends
            if sample.detokenizer is not None or sample.logprobs is not None or sample.structured:
                self._post_ids.add(child.request_id)
            if params.has_penalties:
                self._penalty_ids.add(child.request_id)
        if spec is not None:
            self._grammars.register([child.request_id for child in children], spec)

    def load_lora(self, lora_request: LoRARequest) -> LoadedAdapter:
        """Read and validate an adapter now (kept in host memory, least recently used evicted);
        raises LoRAAdapterError naming the problem, ValueError without ``enable_lora``."""
        if self.lora is None:
            raise ValueError(f"LoRA adapter {lora_request.lora_name!r} requested, but this engine was "
                             "started without enable_lora")
        return self.lora.load(lora_request)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request (all its samples); its output (``finish_reason="abort"``) comes from the
        next step()."""
        parent = self._parents.get(request_id)
        if parent is None:
            return False
        output = None
        for child in parent.children:
            if self.scheduler.abort_request(child.request_id) is not None:
                output = self._sample_finished(child) or output
        if output is not None:
            self._pending.append(output)
        return True

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks now (they stop with the engine's process or when it
        is garbage collected otherwise); no-op with one rank."""
        if self._step_queue is not None:
            self._step_queue.shutdown()
        if self.parallel is not None:
            self.parallel.shutdown()
        if self.kv_connector is not None:
            self.kv_connector.shutdown()  # its queued saves are written first

    def has_unfinished_requests(self) -> bool:
        """Whether a step() has anything to do: requests, outputs to report, a launched step to take
        or a KV store copy to see through (so a caller stepping until this is False leaves nothing
        running on the device)."""
        return (bool(self._pending) or self._in_flight is not None or self._saving is not None
                or self.scheduler.has_unfinished_requests())

    # ---- one step ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; returns the requests that finished (including rejected and aborted ones)."""
        if self.async_scheduling:
            return self._step_async()
        started = time.monotonic()
        outputs, self._pending = self._pending, []
        finished: list[Request] = self._poll_grammars() if self._grammars.compiling else []
        if self._speculator is not None:
            self._speculator.before_schedule(self.scheduler.running)
        if self.kv_connector is not None:
            self.kv_connector.flush_saves()  # blocks cached between steps (aborts), before reuse
        scheduled = self.scheduler.schedule()
        if self._speculator is not None:
            self._speculator.after_schedule(scheduled)
        if scheduled.chunks:
            step = self._prepare(scheduled, started)
            result = self.device.sample_step(step.prepared, step.batch, step.row_ids)
            finished += self._apply(step, result)
        elif (self._grammars.compiling or self._kv_loads_pending()) and not outputs and not finished:
            # Only requests waiting for their grammars or prefix KV loads: yield the CPU to those threads
            # instead of spinning (the LLM loop and the worker's engine thread call step() back to back).
            time.sleep(GRAMMAR_WAIT_S)
        return outputs + self._finished_outputs(finished)

    def _step_async(self) -> list[RequestOutput]:
        """One step with async scheduling: step N+1 is scheduled, prepared and launched while step N
        runs on the device; then step N's outputs are taken. Grammar rows' bitmask for step N+1
        needs their step-N token: it is filled once step N's outputs are taken and handed to step
        N+1, whose forward pass has been running meanwhile (only its sampling waits: vLLM's way).
        Penalty rows' step-N token is counted on the device, from step N's sampled ids.
        N-gram drafts run ahead too (`_drafts_run_ahead`): step N+1 verifies drafts looked up as if
        step N's were all accepted, after the token step N samples (a placeholder); where step N
        rejects a draft, the request's chunk in step N+1 is void and it goes on from its accepted
        tokens in step N+2. Other drafts (a draft model's; rows whose sampling or grammar reads
        their last tokens on the host) run synchronously: the step in flight is taken first."""
        started = time.monotonic()
        outputs, self._pending = self._pending, []
        finished: list[Request] = self._poll_grammars() if self._grammars.compiling else []
        in_flight, self._in_flight = self._in_flight, None
        proposers = self._speculator.plan(len(self.scheduler.running)) if self._speculator is not None else 0
        ahead = bool(proposers) and self._drafts_run_ahead()
        if proposers and not ahead and in_flight is not None:
            finished += self._complete(in_flight)
            in_flight = None
        if proposers:
            assert self._speculator is not None
            self._speculator.before_schedule(self.scheduler.running, proposers)
        self._flush_saves()
        scheduled = self.scheduler.schedule()
        if self._speculator is not None:
            self._speculator.after_schedule(scheduled)
        launched = None
        if not ahead and any(chunk.spec_token_ids for chunk in scheduled.chunks):
            step = self._prepare(scheduled, started)  # nothing in flight: the drafts' step waited
            finished += self._apply(step, self._run_now(step))
        elif scheduled.chunks:
            launched = self._prepare(scheduled, started, defer_bitmask=in_flight is not None)
            queue = self._step_queue
            assert queue is not None  # a step runs ahead only with the step queue
            launched.future = queue.submit(self.device, launched.prepared, launched.batch, launched.row_ids)
            self.scheduler.commit_in_flight(scheduled)
            self._in_flight = launched
        if in_flight is not None:
            try:
                finished += self._complete(in_flight)
            finally:
                if launched is not None and launched.batch.pending_bitmask is not None:
                    self._hand_bitmask(launched)
        elif self._in_flight is None and (self._grammars.compiling or self._kv_loads_pending()) \
                and not outputs and not finished:
            time.sleep(GRAMMAR_WAIT_S)
        return outputs + self._finished_outputs(finished)

    def _drafts_run_ahead(self) -> bool:
        """Whether this step's drafts can be proposed and verified while the step before it runs:
        n-gram drafts (a lookup the host makes from the tokens it has), and no running request
        whose sampling or grammar reads its last tokens on the host (penalties count every
        accepted draft; a bitmask follows them)."""
        assert self._speculator is not None
        if self._speculator.draft is not None:
            return False
        penalties, grammars = self._penalty_ids, self._grammars.ids
        if not penalties and not grammars:  # the common case: no walk over the running rows
            return True
        return not any(request.request_id in penalties or request.request_id in grammars
                       for request in self.scheduler.running)

    def _run_now(self, step: _Step) -> SampledStep:
        """Run a step with none in flight before it and wait for it: on this thread (the step
        thread's hop each way cost more than the step's host work here, bench host) unless a KV
        store copy queued there must go first. No later step reads its sampled ids on the device:
        the next one is prepared after its tokens are on the host."""
        if self._saving is None:
            return self.device.sample_step(step.prepared, step.batch, step.row_ids)
        assert self._step_queue is not None
        return self._step_queue.submit(self.device, step.prepared, step.batch, step.row_ids).result()

    def _flush_saves(self) -> None:
        """Copy the blocks offered to the KV store out of the cache. With async scheduling the copy
        runs on the step thread, after the step in flight (whose chunk may still be writing a block
        the scheduler counts as computed) and before any later step can reuse the block."""
        if self.kv_connector is None:
            return
        if self._step_queue is None:
            self.kv_connector.flush_saves()
            return
        if self._saving is not None:
            self._saving.result()  # a copy that failed fails the engine here, not silently
            self._saving = None
        if self.kv_connector.has_offers:
            offers = self.kv_connector.take_offers()  # the connector's books stay on this thread
            connector = self.kv_connector
            self._saving = self._step_queue.call(lambda: connector.save_offers(offers))

    def _hand_bitmask(self, step: _Step) -> None:
        """Fill a launched step's grammar bitmask (its rows' grammars now hold every token sampled
        before it) and hand it to the step's sampling."""
        pending = step.batch.pending_bitmask
        assert pending is not None
        try:
            pending.set_result(self._grammars.bitmask(step.row_ids))
        except BaseException as error:  # the step fails with it instead of waiting forever
            pending.set_exception(error)
            raise

    def _complete(self, step: _Step) -> list[Request]:
        """Wait for a launched step's sampled ids and apply them."""
        assert step.future is not None
        return self._apply(step, step.future.result())

    def _prepare(self, scheduled: SchedulerOutput, started: float, defer_bitmask: bool = False) -> _Step:
        """Host work before a step's forward pass: its input tensors and its sampling settings
        (with `defer_bitmask`, a grammar bitmask comes later: `_hand_bitmask`)."""
        sampling = [c for c in scheduled.chunks if c.samples]
        prepared = self.device.prepare_step(scheduled)
        batch, spans, row_ids = self._sampling_batch(sampling, defer_bitmask and bool(self._grammars.ids))
        return _Step(scheduled, sampling, prepared, batch, spans, row_ids, started)

    def _apply(self, step: _Step, result: SampledStep) -> list[Request]:
        """Host work after a step: its tokens appended, stops checked, per-token work done;
        returns the requests it finished."""
        finished: list[Request] = []
        scheduled, sampling = step.scheduled, step.sampling
        prefill_tokens = 0
        for chunk in scheduled.chunks:
            if chunk.start < chunk.request.num_prompt_tokens:
                prefill_tokens += min(chunk.start + chunk.num_new_tokens, chunk.request.num_prompt_tokens) \
                    - chunk.start
        first_tokens = 0
        outputs_before = {}
        for chunk in sampling:
            request = chunk.request
            outputs_before[request.request_id] = before = len(request.output_token_ids)
            if not before and not request.is_finished:
                first_tokens += request.num_prompt_tokens
        self._keep_prompt_logprobs(result.prompt_logprobs)
        sampled, logprobs = self._take_sampled(result, step, finished)
        finished += self.scheduler.update_from_output(scheduled, sampled, committed=step.future is not None)
        if self._post_ids:
            finished += self._after_sampling(sampling, outputs_before, logprobs)
        generated = 0
        for chunk in sampling:
            generated += len(chunk.request.output_token_ids) - outputs_before[chunk.request.request_id]
        self.counters.generation_tokens += generated
        self.counters.prompt_tokens += first_tokens
        self._flush_saves()  # this step's shared blocks, copied before reuse
        # The step's share of the wall: since it started, or since the step before it was taken where
        # it was launched before that (async scheduling: steps overlap; none is counted twice).
        now = time.monotonic()
        duration = now - max(step.started, self._last_applied)
        self._last_applied = now
        self.counters.record_step(duration, scheduled.num_scheduled_tokens, prefill_tokens)
        _attribute_step(scheduled.chunks, duration, scheduled.num_scheduled_tokens)
        return finished

    def _finished_outputs(self, finished: list[Request]) -> list[RequestOutput]:
        outputs = []
        for request in finished:
            output = self._sample_finished(request)
            if output is not None:
                outputs.append(output)
                if output.finish_reason == str(FinishReason.ERROR):
                    self.counters.num_errors += 1
                else:
                    self.counters.num_finished += 1
        return outputs

    def _kv_loads_pending(self) -> bool:
        return self.kv_connector is not None and self.kv_connector.has_pending_loads()

    def _keep_prompt_logprobs(self, scored: dict[str, list[RowLogprobs]]) -> None:
        """Append a step's scored prompt positions to their requests' (in position order: chunks
        run in order and a request's scored count only grows)."""
        for request_id, rows in scored.items():
            sample = self._samples.get(request_id)
            if sample is None:  # ended (aborted) while its step ran
                continue
            assert sample.parent.prompt_logprobs is not None
            sample.parent.prompt_logprobs.extend(rows)
            sample.request.num_prompt_logprobs += len(rows)

    def _sampling_batch(
        self, chunks: list[ScheduledChunk], defer_bitmask: bool = False
    ) -> tuple[SamplingBatch, list[tuple[int, int]], list[str]]:
        """The sampling settings of a step's sampled rows (one per sampling chunk, 1 + drafts for a
        chunk verifying drafts), each chunk's (first row, count), and each row's request id.
        `defer_bitmask`: the grammar bitmask is handed over later (`SamplingBatch.pending_bitmask`)."""
        rows: list[Any] = []
        spans: list[tuple[int, int]] = []
        drafts_before: list[tuple[int, ...]] = []
        if self._speculator is None:  # one row a chunk
            rows = [chunk.request for chunk in chunks]
            spans = [(i, 1) for i in range(len(chunks))]
        else:
            for chunk in chunks:
                positions = sampled_positions(chunk.request, chunk.spec_token_ids)
                spans.append((len(rows), len(positions)))
                rows.extend(positions)
                drafts_before.extend(chunk.spec_token_ids[:j] for j in range(len(positions)))
        verifying = len(rows) > len(chunks)
        row_ids = [row.request_id for row in rows]
        if defer_bitmask:
            batch = SamplingBatch.build(rows, self.eos_token_ids)
            batch.pending_bitmask = concurrent.futures.Future()
            return batch, spans, row_ids
        bitmask, apply_bitmask = self._grammars.bitmask(row_ids, drafts_before if verifying else None) \
            if rows else (None, None)
        batch = SamplingBatch.build(rows, self.eos_token_ids, bitmask=bitmask, apply_bitmask=apply_bitmask)
        return batch, spans, row_ids

    def _take_sampled(
        self, result: SampledStep, step: _Step, finished: list[Request]
    ) -> tuple[dict[str, list[int]], dict[str, list[RowLogprobs | None]]]:
        """The new tokens of each sampling chunk's request (one, or the accepted drafts and the
        token after them when it verified drafts), with the logprobs of each. A request whose
        logits are not finite at a kept position (NaN/inf: a numerical fault in the model or its
        dtype) ends with an error instead of emitting junk (added to `finished`, left out)."""
        invalid = set(result.invalid_rows)
        if not invalid and self._speculator is None:  # one token a chunk, every one kept
            token_ids, row_logprobs = result.token_ids, result.logprobs
            return ({chunk.request.request_id: [token_ids[i]] for i, chunk in enumerate(step.sampling)},
                    {chunk.request.request_id: [row_logprobs[i]] for i, chunk in enumerate(step.sampling)})
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, list[RowLogprobs | None]] = {}
        for chunk, (first, count) in zip(step.sampling, step.spans, strict=True):
            request_id = chunk.request.request_id
            if chunk.void:  # continued from drafts the step before rejected: nothing of it is kept
                continue
            tokens = accepted_tokens(result.token_ids[first : first + count], chunk.spec_token_ids)
            if self._speculator is not None and chunk.spec_token_ids:
                self._speculator.record(request_id, len(chunk.spec_token_ids), len(tokens) - 1)
                add_outcome(chunk.request.spec_drafted_per_position, chunk.request.spec_accepted_per_position,
                            len(chunk.spec_token_ids), len(tokens) - 1)
            if invalid and any(row in invalid for row in range(first, first + len(tokens))):
                request = self.scheduler.finish_request(request_id, FinishReason.ERROR, NON_FINITE_LOGITS,
                                                        ErrorKind.NON_FINITE_LOGITS)
                if request is not None:
                    finished.append(request)
                continue  # nothing appends its tokens: the request ends here
            sampled[request_id] = tokens
            logprobs[request_id] = result.logprobs[first : first + len(tokens)]
        return sampled, logprobs

    def _after_sampling(
        self, chunks: list[ScheduledChunk], outputs_before: dict[str, int],
        logprobs: dict[str, list[RowLogprobs | None]],
    ) -> list[Request]:
        """Per-token work of the samples that need it, token by token: logprobs, stop strings,
        grammar. A stop string or an ended grammar on a token drops the tokens after it (drafts
        accepted in the same step). Returns the requests this ends (already finished in the
        scheduler)."""
        finished: list[Request] = []
        for chunk in chunks:
            request = chunk.request
            request_id = request.request_id
            sample = self._samples.get(request_id) if request_id in self._post_ids else None
            if sample is None or request_id not in logprobs:  # not sampled: ended on bad logits
                continue
            before = outputs_before[request_id]
            new_tokens = request.output_token_ids[before:]
            for j, token_id in enumerate(new_tokens):
                last = j == len(new_tokens) - 1
                row_logprobs = logprobs[request_id][j]
                if sample.logprobs is not None and row_logprobs is not None:
                    sample.logprobs.append(row_logprobs)
                if sample.detokenizer is not None and (not last or text_includes_last_token(request)):
                    # As in vLLM, stop strings end nothing before min_tokens.
                    reached = before + j + 1 >= request.sampling_params.min_tokens
                    stop = sample.detokenizer.add_token(token_id, check_stop=reached)
                    if stop is not None:
                        self._end_at(request, before + j + 1, FinishReason.STOP, finished)
                        request.stop_reason = stop
                        break
                if sample.structured and (not last or not request.is_finished):
                    end = self._grammars.advance(request_id, token_id)
                    if end is not None:
                        reason, error = end
                        kind = ErrorKind.STRUCTURED_OUTPUT if error is not None else None
                        self._end_at(request, before + j + 1, reason, finished, error, kind)
                        break
        return finished

    def _end_at(self, request: Request, num_outputs: int, reason: FinishReason, finished: list[Request],
                error: str | None = None, kind: ErrorKind | None = None) -> None:
        """End the request after its first `num_outputs` output tokens (later ones dropped)."""
        request.truncate_output(num_outputs)
        if request.is_finished:  # max_tokens or EOS on a later (dropped) or the same token: this wins
            request.finish(reason, request.finished_time or time.monotonic(), error, kind)
        else:
            self.scheduler.finish_request(request.request_id, reason, error, kind)
            finished.append(request)

    def _poll_grammars(self) -> list[Request]:
        """Requests whose grammar failed to compile end with an error; ready ones may start."""
        failed: list[Request] = []
        for request_id, error in self._grammars.poll():
            request = self.scheduler.finish_request(request_id, FinishReason.ERROR, error,
                                                    ErrorKind.STRUCTURED_OUTPUT)
            if request is not None:
                failed.append(request)
        return failed

    # ---- finishing ----------------------------------------------------------------------------

    def _sample_finished(self, request: Request) -> RequestOutput | None:
        """Record a finished sample; the parent's output once all its samples are done."""
        sample = self._samples.pop(request.request_id, None)
        if sample is None:
            return None
        self._post_ids.discard(request.request_id)
        self._penalty_ids.discard(request.request_id)
        if request.lora_request is not None and self.lora is not None:
            self.lora.release(request.lora_request)
        if self._speculator is not None:
            self._speculator.release(request.request_id)
        if sample.structured:
            self._grammars.release(request.request_id)
        sample.parent.outputs[request.sample_index] = self._assembler.completion(sample)
        output = parent_output(sample.parent, self._assembler.prompt_logprobs(sample.parent))
        if output is not None:
            self._parents.pop(sample.parent.request_id, None)
        return output

    def _reject(self, parent: Parent, n: int) -> None:
        self.counters.num_errors += 1
        self._pending.append(rejection_output(parent, n))

    # ---- helpers -------------------------------------------------------------------------------

    def _detokenizer(self, request: Request) -> IncrementalDetokenizer:
        params = request.sampling_params
        return IncrementalDetokenizer(
            self.tokenizer,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
        )

    def _tokenize(self, prompt: object) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt)), None
        if not isinstance(prompt, Sequence) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            return [], f"prompt must be a string or a list of token ids, got {type(prompt).__name__}"
        token_ids = list(prompt)
        out_of_vocab = [t for t in token_ids if t >= self._vocab_size]
        if out_of_vocab:
            return token_ids, (
                f"prompt holds token id {out_of_vocab[0]} outside the vocabulary (size {self._vocab_size})"
            )
        return token_ids, None

    # ---- metrics -------------------------------------------------------------------------------

    def kv_store_stats(self) -> dict[str, float]:
        """The prefix KV store's counters (engine/kv_connector/stats.py); all 0 without a store."""
        return self.kv_connector.stats.snapshot() if self.kv_connector is not None else empty_stats()

    def get_metrics(self) -> dict[str, Any]:
        kv = self.scheduler.kv_cache_manager
        speculation = self._speculator.metrics() if self._speculator is not None else None
        return self.counters.snapshot(
            speculative_decoding=speculation,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            kv_blocks_total=kv.block_pool.num_usable_blocks,
            kv_blocks_free=kv.num_free_blocks,
            num_waiting=self.scheduler.num_waiting,
            num_running=self.scheduler.num_running,
        )


@dataclass
class _Step:
    """A step between its preparation on the host and the taking of its outputs."""

    scheduled: SchedulerOutput
    sampling: list[ScheduledChunk]  # the chunks that sample, in order
    prepared: Any  # the device's prepared inputs
    batch: SamplingBatch
    spans: list[tuple[int, int]]  # each sampling chunk's (first row, count) in the sampled rows
    row_ids: list[str]  # each sampled row's request id
    started: float
    future: concurrent.futures.Future[SampledStep] | None = None  # launched ahead (async scheduling)


def _params_error(params: SamplingParams) -> tuple[ErrorKind, str] | None:
    try:
        params.validate()
    except SamplingParamsError as exc:
        return exc.kind, f"invalid sampling params: {exc}"
    except ValueError as exc:  # a subclass' own check
        return ErrorKind.INVALID_SAMPLING, f"invalid sampling params: {exc}"
    return None


def _attribute_step(chunks: list[ScheduledChunk], duration: float, num_tokens: int) -> None:
    """Split a step's time over its requests by the tokens each computed in it (usage accounting)."""
    if num_tokens <= 0:
        return
    per_token = duration / num_tokens
    for chunk in chunks:
        chunk.request.engine_seconds += per_token * chunk.num_new_tokens
