"""LLMEngine: requests in, finished outputs out; one ``step()`` = schedule -> forward -> sample -> update."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.attention import TorchPagedAttention
from engine.config import EngineConfig
from engine.metrics import EngineCounters, RequestMetrics
from engine.model_runner import DTYPES, ModelRunner
from engine.models.loader import load_model, model_config_from_dir
from engine.request import FinishReason, Request
from engine.sampler import Sampler, SamplingBatch, request_generator
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None  # the text given, or None when the prompt was token ids
    prompt_token_ids: list[int]
    text: str  # output tokens detokenized, special tokens skipped
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort", "error"
    error: str | None
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served by the prefix cache
    num_completion_tokens: int
    metrics: RequestMetrics | None
    finished: bool = True


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
        self.scheduler = Scheduler(config, num_blocks, eos)
        self.sampler = Sampler(config.seed)
        self.counters = EngineCounters()
        self._vocab_size = model_config.vocab_size
        self._prompts: dict[str, str | None] = {}
        self._generators: dict[str, torch.Generator] = {}
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
        params = params if params is not None else SamplingParams()
        prompt_text = prompt if isinstance(prompt, str) else None
        token_ids, error = self._tokenize(prompt)
        request = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            priority=priority,
        )
        if error is not None:
            request.finish(FinishReason.ERROR, time.monotonic(), error=error)
        elif self.scheduler.add_request(request):
            self._prompts[request_id] = prompt_text
            generator = request_generator(params.seed)
            if generator is not None:
                self._generators[request_id] = generator
            return
        self.counters.num_errors += 1
        self._pending.append(self._output(request, prompt_text))

    def abort_request(self, request_id: str) -> bool:
        """Stop a request; its output (``finish_reason="abort"``) comes from the next step()."""
        request = self.scheduler.abort_request(request_id)
        if request is None:
            return False
        self._pending.append(self._output(request, self._prompts.pop(request_id, None)))
        self._generators.pop(request_id, None)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._pending) or self.scheduler.has_unfinished_requests()

    # ---- one step ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; returns the requests that finished (including rejected and aborted ones)."""
        started = time.monotonic()
        outputs, self._pending = self._pending, []
        scheduled = self.scheduler.schedule()
        if not scheduled.chunks:
            return outputs
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
        sampled = self._sample(logits, sampling)
        finished = self.scheduler.update_from_output(scheduled, sampled)

        self.counters.generation_tokens += len(sampled)
        self.counters.prompt_tokens += first_tokens
        for request in finished:
            self._generators.pop(request.request_id, None)
            outputs.append(self._output(request, self._prompts.pop(request.request_id, None)))
        self.counters.num_finished += len(finished)
        self.counters.record_step(time.monotonic() - started, scheduled.num_scheduled_tokens, prefill_tokens)
        return outputs

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> dict[str, int]:
        if not requests:
            return {}
        batch = SamplingBatch.build(
            [r.sampling_params for r in requests], [self._generators.get(r.request_id) for r in requests]
        )
        tokens = self.sampler.sample(logits, batch)
        return {r.request_id: t for r, t in zip(requests, tokens, strict=True)}

    # ---- helpers -------------------------------------------------------------------------------

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

    def _output(self, request: Request, prompt_text: str | None) -> RequestOutput:
        token_ids = list(request.output_token_ids)
        return RequestOutput(
            request_id=request.request_id,
            prompt=prompt_text,
            prompt_token_ids=list(request.prompt_token_ids),
            text=self.tokenizer.decode(token_ids, skip_special_tokens=True) if token_ids else "",
            token_ids=token_ids,
            finish_reason=str(request.finish_reason) if request.finish_reason is not None else None,
            error=request.error,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            num_completion_tokens=len(token_ids),
            metrics=RequestMetrics.from_request(request),
            finished=request.is_finished,
        )

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
