"""LLMEngine: requests in, finished outputs out; one ``step()`` = schedule -> forward -> sample -> update."""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.attention import TorchPagedAttention
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.metrics import EngineCounters, RequestMetrics
from engine.model_runner import DTYPES, ModelRunner
from engine.models.loader import load_model, model_config_from_dir
from engine.outputs import CompletionOutput, PositionLogprobs, RequestOutput, TokenLogprob
from engine.request import FinishReason, Request
from engine.sampler import RowLogprobs, Sampler, SamplingBatch
from engine.sampling_params import STRUCTURED_FIELDS, SamplingParams
from engine.sampling_random import SEED_MASK
from engine.scheduler import Scheduler
from engine.token_bytes import TokenBytes

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


@dataclass(eq=False)
class _Parent:
    """A request as the caller sees it: one prompt, n samples."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    outputs: dict[int, CompletionOutput] = dataclasses.field(default_factory=dict)


@dataclass(eq=False)
class _Sample:
    """Engine-side state of one scheduled sequence (one sample of a parent)."""

    parent: _Parent
    request: Request
    detokenizer: IncrementalDetokenizer | None  # only with stop strings
    logprobs: list[RowLogprobs] | None
    structured: bool


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
        max_len = model_config.max_position_embeddings
        if config.max_model_len is None:
            config = dataclasses.replace(config, max_model_len=max_len)
        elif config.max_model_len > max_len:
            raise ValueError(
                f"max_model_len={config.max_model_len} exceeds the model's max_position_embeddings={max_len}"
            )
        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(config.model)
        self.model = load_model(
            config.model,
            TorchPagedAttention(),
            dtype=DTYPES[config.dtype],
            device=config.device,
            # Most FLOPs run in full steps (prefill chunks), so pack the weights for that size.
            batch_hint=config.max_num_batched_tokens,
        )
        self.runner = ModelRunner(config, self.model)
        num_blocks = self.runner.initialize_kv_cache()
        eos = self.tokenizer.eos_token_id
        if eos is None and model_config.eos_token_ids:
            eos = model_config.eos_token_ids[0]
        self.eos_token_id = eos
        self.scheduler = Scheduler(config, num_blocks, eos)
        self.scheduler.can_admit = self._can_admit
        self.sampler = Sampler()
        # Seeds of unseeded requests: reproducible per engine run (config.seed), not per request.
        self._seed_rng = random.Random(config.seed)
        self.counters = EngineCounters()
        self._vocab_size = model_config.vocab_size
        self._parents: dict[str, _Parent] = {}
        self._samples: dict[str, _Sample] = {}  # by scheduler request id
        # Samples that need per-token work after sampling (stop strings, grammar, logprobs).
        self._post_ids: set[str] = set()
        self._structured: Any = None  # StructuredOutputManager, built on the first structured request
        self._structured_ids: set[str] = set()  # live samples with a grammar
        self._compiling: set[str] = set()  # of those, the ones whose grammar is not ready yet
        self._token_bytes: TokenBytes | None = None
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
        arrival = time.monotonic() if arrival_time is None else arrival_time
        params_error = _params_error(params)
        error = error or params_error
        spec = None
        if error is None:
            spec, error = self._structured_spec(params)
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
        parent = _Parent(request_id, prompt_text, list(token_ids), children)
        if error is not None:
            children[0].finish(FinishReason.ERROR, time.monotonic(), error=error)
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
            sample = _Sample(
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
            manager = self._structured_manager()
            for child in children:
                manager.register(child.request_id, spec)
                self._structured_ids.add(child.request_id)
                self._compiling.add(child.request_id)

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
        finished: list[Request] = self._poll_grammars() if self._compiling else []
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
            sampled, logprobs = self._sample(logits, sampling)
            finished += self.scheduler.update_from_output(scheduled, sampled)
            if self._post_ids:
                finished += self._after_sampling(sampling, sampled, logprobs)
            self.counters.generation_tokens += len(sampled)
            self.counters.prompt_tokens += first_tokens
            self.counters.record_step(
                time.monotonic() - started, scheduled.num_scheduled_tokens, prefill_tokens
            )
        elif self._compiling and not outputs and not finished:
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
        self, logits: torch.Tensor, requests: list[Request]
    ) -> tuple[dict[str, int], list[RowLogprobs | None]]:
        if not requests:
            return {}, []
        bitmask = None
        if self._structured_ids:
            structured = self._structured_ids
            ids = [r.request_id if r.request_id in structured else None for r in requests]
            bitmask = self._structured.fill_bitmask(ids)
        batch = SamplingBatch.build(
            requests,
            self.eos_token_id,
            bitmask=bitmask,
            apply_bitmask=self._structured.apply_bitmask if bitmask is not None else None,
        )
        result = self.sampler.sample(logits, batch)
        sampled = {r.request_id: t for r, t in zip(requests, result.token_ids, strict=True)}
        return sampled, result.logprobs

    def _after_sampling(
        self, requests: list[Request], sampled: dict[str, int], logprobs: list[RowLogprobs | None]
    ) -> list[Request]:
        """Per-token work of the samples that need it: logprobs, grammar, stop strings.
        Returns the requests this ends (already finished in the scheduler)."""
        finished: list[Request] = []
        for row, request in enumerate(requests):
            sample = self._samples.get(request.request_id) if request.request_id in self._post_ids else None
            if sample is None:
                continue
            token_id = sampled[request.request_id]
            if sample.logprobs is not None and logprobs[row] is not None:
                sample.logprobs.append(logprobs[row])  # type: ignore[arg-type]
            if sample.detokenizer is not None and self._text_includes_last_token(request):
                stop = sample.detokenizer.add_token(token_id)
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
        manager = self._structured
        if not manager.accept_token(request.request_id, token_id):
            error = f"structured output: the grammar rejected token {token_id}"
            self.scheduler.finish_request(request.request_id, FinishReason.ERROR, error)
            finished.append(request)
        elif manager.is_terminated(request.request_id):
            self.scheduler.finish_request(request.request_id, FinishReason.STOP)
            finished.append(request)

    # ---- structured output ----------------------------------------------------------------------

    def _structured_spec(self, params: SamplingParams) -> tuple[Any, str | None]:
        """The request's spec, with the manager built on first use; an error if xgrammar is missing."""
        if all(getattr(params, name) is None for name in STRUCTURED_FIELDS):
            return None, None
        try:
            spec = params.structured
            self._structured_manager()
        except ImportError as exc:
            return None, f"structured output needs xgrammar (the worker extra): {exc}"
        return spec, None

    def _structured_manager(self) -> Any:
        if self._structured is None:
            from engine.structured_output import StructuredOutputManager  # xgrammar: only when used

            self._structured = StructuredOutputManager(
                self.tokenizer, self._vocab_size, self.config.max_num_seqs
            )
        return self._structured

    def _can_admit(self, request: Request) -> bool:
        return request.request_id not in self._compiling

    def _poll_grammars(self) -> list[Request]:
        """Requests whose grammar failed to compile end with an error; ready ones may start."""
        failed: list[Request] = []
        for request_id in list(self._compiling):
            state = self._structured.state(request_id)
            if state == "compiling":
                continue
            self._compiling.discard(request_id)
            if state == "failed":
                reason = self._structured.error(request_id) or "the grammar failed to compile"
                request = self.scheduler.finish_request(
                    request_id, FinishReason.ERROR, f"structured output: {reason}"
                )
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
            self._compiling.discard(request.request_id)
            self._structured_ids.discard(request.request_id)
            self._structured.release(request.request_id)
        sample.parent.outputs[request.sample_index] = self._completion(sample)
        return self._parent_output(sample.parent)

    def _completion(self, sample: _Sample) -> CompletionOutput:
        request = sample.request
        params = request.sampling_params
        if sample.detokenizer is not None:
            stop = sample.detokenizer.finish()  # flush an incomplete trailing character
            if stop is not None and request.finish_reason is not FinishReason.STOP:
                request.finish_reason, request.stop_reason = FinishReason.STOP, stop
            text = sample.detokenizer.text
        else:
            token_ids = request.output_token_ids
            if token_ids and not self._text_includes_last_token(request):
                token_ids = token_ids[:-1]
            text = self.tokenizer.decode(token_ids, skip_special_tokens=params.skip_special_tokens)
        return CompletionOutput(
            index=request.sample_index,
            text=text if request.output_token_ids else "",
            token_ids=list(request.output_token_ids),
            finish_reason=str(request.finish_reason) if request.finish_reason is not None else None,
            stop_reason=request.stop_reason,
            logprobs=self._position_logprobs(sample.logprobs) if sample.logprobs is not None else None,
        )

    @staticmethod
    def _text_includes_last_token(request: Request) -> bool:
        """A stop token (EOS or stop id) is left out of the text, as in vLLM."""
        return not request.stopped_on_token or request.sampling_params.include_stop_str_in_output

    def _parent_output(self, parent: _Parent) -> RequestOutput | None:
        if len(parent.outputs) < len(parent.children):
            return None
        self._parents.pop(parent.request_id, None)
        outputs = [parent.outputs[i] for i in range(len(parent.children))]
        first = parent.children[0]
        error = next((c.error for c in parent.children if c.error is not None), None)
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=list(parent.prompt_token_ids),
            text=outputs[0].text,
            token_ids=outputs[0].token_ids,
            finish_reason=outputs[0].finish_reason,
            error=error,
            num_prompt_tokens=first.num_prompt_tokens,
            num_cached_tokens=first.num_cached_tokens,
            num_completion_tokens=sum(len(o.token_ids) for o in outputs),
            metrics=RequestMetrics.merged([RequestMetrics.from_request(c) for c in parent.children]),
            finished=all(c.is_finished for c in parent.children),
            outputs=outputs,
        )

    def _reject(self, parent: _Parent, n: int) -> None:
        self.counters.num_errors += 1
        request = parent.children[0]
        completion = CompletionOutput(0, "", [], str(FinishReason.ERROR))
        self._pending.append(
            RequestOutput(
                request_id=parent.request_id,
                prompt=parent.prompt,
                prompt_token_ids=list(parent.prompt_token_ids),
                text="",
                token_ids=[],
                finish_reason=str(FinishReason.ERROR),
                error=request.error,
                num_prompt_tokens=request.num_prompt_tokens,
                num_cached_tokens=0,
                num_completion_tokens=0,
                metrics=RequestMetrics.from_request(request),
                finished=True,
                outputs=[dataclasses.replace(completion, index=i) for i in range(n)],
            )
        )

    def _position_logprobs(self, rows: list[RowLogprobs]) -> list[PositionLogprobs]:
        if self._token_bytes is None:
            self._token_bytes = TokenBytes(self.tokenizer)
        token_bytes = self._token_bytes

        def entry(token_id: int, logprob: float) -> TokenLogprob:
            text, raw = token_bytes.get(token_id)
            return TokenLogprob(token_id, text, logprob, raw)

        return [
            PositionLogprobs(
                chosen=entry(row.token_id, row.chosen),
                top=[entry(t, lp) for t, lp in zip(row.top_ids, row.top_logprobs, strict=True)],
            )
            for row in rows
        ]

    # ---- helpers -------------------------------------------------------------------------------

    def _detokenizer(self, request: Request) -> IncrementalDetokenizer:
        params = request.sampling_params
        return IncrementalDetokenizer(
            self.tokenizer,
            request.prompt_token_ids,
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


def _params_error(params: SamplingParams) -> str | None:
    try:
        params.validate()
    except ValueError as exc:
        return f"invalid sampling params: {exc}"
    return None
