"""LLMEngine: requests in, finished outputs out; one ``step()`` = schedule -> forward -> sample -> update."""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Sequence
from typing import Any

import torch

from engine import cpu_kernels
from engine.attention import TorchPagedAttention
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.dtype_choice import DtypeChoice, checkpoint_dtype, resolve_dtype
from engine.errors import ErrorKind, SamplingParamsError
from engine.grammar_tracking import GrammarTracker
from engine.metrics import EngineCounters
from engine.model_runner import ModelRunner
from engine.models.loader import eos_token_ids, load_model, model_config_from_dir
from engine.output_assembly import (
    OutputAssembler,
    Parent,
    Sample,
    parent_output,
    rejection_output,
    text_includes_last_token,
)
from engine.outputs import CompletionOutput, PositionLogprobs, RequestOutput, TokenLogprob
from engine.request import FinishReason, Request
from engine.sampler import RowLogprobs, Sampler, SamplingBatch
from engine.sampling_params import SamplingParams
from engine.sampling_random import SEED_MASK
from engine.scheduler import ScheduledChunk, Scheduler

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
        self.dtype_choice: DtypeChoice = resolve_dtype(
            config.dtype, config.device, checkpoint_dtype(config.model)
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
        kernels = cpu_kernels.load() if config.device == "cpu" else None
        self.model = load_model(
            config.model,
            TorchPagedAttention(kernels=kernels),
            dtype=self.dtype_choice.torch_dtype,
            device=config.device,
            # Most FLOPs run in full steps (prefill chunks), so pack the weights for that size.
            batch_hint=config.max_num_batched_tokens,
        )
        self.model.use_cpu_kernels(kernels)
        self.runner = ModelRunner(config, self.model)
        num_blocks = self.runner.initialize_kv_cache()
        self.eos_token_ids = eos_token_ids(config.model, self.tokenizer, model_config.eos_token_ids)
        self.eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None  # the primary one
        self.scheduler = Scheduler(config, num_blocks, self.eos_token_ids)
        # Structured output: grammars of live samples; xgrammar is imported on the first such request.
        self._grammars = GrammarTracker(self.tokenizer, model_config.vocab_size, config.max_num_seqs)
        self.scheduler.can_admit = self._grammars.can_admit
        self.sampler = Sampler()
        # Seeds of unseeded requests: reproducible per engine run (config.seed), not per request.
        self._seed_rng = random.Random(config.seed)
        self.counters = EngineCounters()
        self._vocab_size = model_config.vocab_size
        self._parents: dict[str, Parent] = {}
        self._samples: dict[str, Sample] = {}  # by scheduler request id
        # Samples that need per-token work after sampling (stop strings, grammar, logprobs).
        self._post_ids: set[str] = set()
        self._assembler = OutputAssembler(self.tokenizer)
        self._pending: list[RequestOutput] = []  # rejected / aborted, reported by the next step()

    # ---- requests ------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request. ``arrival_time`` is ``time.monotonic()`` seconds (default: now)."""
        if request_id in self._parents:
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        params = params if params is not None else SamplingParams()
        prompt_text = prompt if isinstance(prompt, str) else None
        token_ids, error = self._tokenize(prompt)
        kind = ErrorKind.INVALID_PROMPT if error is not None else None
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
                sample_seed=seed & SEED_MASK,
                sample_index=i,
            )
            for i in range(n if error is None else 1)
        ]
        parent = Parent(request_id, prompt_text, list(token_ids), children)
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
            if sample.detokenizer is not None or sample.logprobs is not None or sample.structured:
                self._post_ids.add(child.request_id)
        if spec is not None:
            self._grammars.register([child.request_id for child in children], spec)

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

    def has_unfinished_requests(self) -> bool:
        return bool(self._pending) or self.scheduler.has_unfinished_requests()

    # ---- one step ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; returns the requests that finished (including rejected and aborted ones)."""
        started = time.monotonic()
        outputs, self._pending = self._pending, []
        finished: list[Request] = self._poll_grammars() if self._grammars.compiling else []
        scheduled = self.scheduler.schedule()
        if scheduled.chunks:
            sampling = [c.request for c in scheduled.chunks if c.samples]
            prefill_tokens = sum(
                max(
                    0,
                    min(c.request.num_computed_tokens + c.num_new_tokens, c.request.num_prompt_tokens)
                    - c.request.num_computed_tokens,
                )
                for c in scheduled.chunks
            )
            first_tokens = sum(r.num_prompt_tokens for r in sampling if not r.output_token_ids)
            logits = self.runner.execute(scheduled)
            sampled, logprobs = self._sample(logits, sampling, finished)
            finished += self.scheduler.update_from_output(scheduled, sampled)
            if self._post_ids:
                finished += self._after_sampling(sampling, sampled, logprobs)
            self.counters.generation_tokens += len(sampled)
            self.counters.prompt_tokens += first_tokens
            duration = time.monotonic() - started
            self.counters.record_step(duration, scheduled.num_scheduled_tokens, prefill_tokens)
            _attribute_step(scheduled.chunks, duration, scheduled.num_scheduled_tokens)
        elif self._grammars.compiling and not outputs and not finished:
            # Only requests waiting for their grammars: yield the CPU to the compile threads
            # instead of spinning (the LLM loop and the worker's engine thread call step() back to back).
            time.sleep(GRAMMAR_WAIT_S)
        for request in finished:
            output = self._sample_finished(request)
            if output is not None:
                outputs.append(output)
                if output.finish_reason == str(FinishReason.ERROR):
                    self.counters.num_errors += 1
                else:
                    self.counters.num_finished += 1
        return outputs

    def _sample(
        self, logits: torch.Tensor, requests: list[Request], finished: list[Request]
    ) -> tuple[dict[str, int], list[RowLogprobs | None]]:
        """A token per request; a request whose logits are not finite (NaN/inf: a numerical fault
        in the model or its dtype) ends with an error instead of emitting junk (added to
        `finished`, left out of the returned tokens)."""
        if not requests:
            return {}, []
        bitmask, apply_bitmask = self._grammars.bitmask(requests)
        batch = SamplingBatch.build(requests, self.eos_token_ids, bitmask=bitmask,
                                    apply_bitmask=apply_bitmask)
        result = self.sampler.sample(logits, batch)
        sampled = {r.request_id: t for r, t in zip(requests, result.token_ids, strict=True)}
        for row in result.invalid_rows:
            request_id = requests[row].request_id
            del sampled[request_id]  # nothing appends it: the request ends here
            request = self.scheduler.finish_request(request_id, FinishReason.ERROR, NON_FINITE_LOGITS,
                                                    ErrorKind.NON_FINITE_LOGITS)
            if request is not None:
                finished.append(request)
        return sampled, result.logprobs

    def _after_sampling(
        self, requests: list[Request], sampled: dict[str, int], logprobs: list[RowLogprobs | None]
    ) -> list[Request]:
        """Per-token work of the samples that need it: logprobs, grammar, stop strings.
        Returns the requests this ends (already finished in the scheduler)."""
        finished: list[Request] = []
        for row, request in enumerate(requests):
            sample = self._samples.get(request.request_id) if request.request_id in self._post_ids else None
            if sample is None or request.request_id not in sampled:  # not sampled: ended on bad logits
                continue
            token_id = sampled[request.request_id]
            if sample.logprobs is not None and logprobs[row] is not None:
                sample.logprobs.append(logprobs[row])  # type: ignore[arg-type]
            if sample.detokenizer is not None and text_includes_last_token(request):
                # As in vLLM, stop strings end nothing before min_tokens.
                reached = request.num_output_tokens >= request.sampling_params.min_tokens
                stop = sample.detokenizer.add_token(token_id, check_stop=reached)
                if stop is not None:
                    self._stop_on_string(request, stop, finished)
            if sample.structured and not request.is_finished:
                self._advance_grammar(request, token_id, finished)
        return finished

    def _stop_on_string(self, request: Request, stop: str, finished: list[Request]) -> None:
        if request.is_finished:  # max_tokens on the same token: the stop string wins
            request.finish(FinishReason.STOP, request.finished_time or time.monotonic())
        else:
            self.scheduler.finish_request(request.request_id, FinishReason.STOP)
            finished.append(request)
        request.stop_reason = stop

    def _advance_grammar(self, request: Request, token_id: int, finished: list[Request]) -> None:
        end = self._grammars.advance(request.request_id, token_id)
        if end is not None:
            reason, error = end
            kind = ErrorKind.STRUCTURED_OUTPUT if error is not None else None
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
        if sample.structured:
            self._grammars.release(request.request_id)
        sample.parent.outputs[request.sample_index] = self._assembler.completion(sample)
        output = parent_output(sample.parent)
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

    def get_metrics(self) -> dict[str, Any]:
        kv = self.scheduler.kv_cache_manager
        return self.counters.snapshot(
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            kv_blocks_total=kv.block_pool.num_usable_blocks,
            kv_blocks_free=kv.num_free_blocks,
            num_waiting=self.scheduler.num_waiting,
            num_running=self.scheduler.num_running,
        )


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
