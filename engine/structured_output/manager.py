"""StructuredOutputManager: compile grammars off the engine loop, mask logits, follow tokens.

The engine calls, per request: ``register`` (starts the compile), ``state`` until "ready" (the
scheduler admits it only then) or "failed" (``error`` says why), then per step ``fill_bitmask``
and ``apply_bitmask`` for the sampled rows, ``accept_token`` after sampling, ``is_terminated``
(the grammar is complete and the stop token taken: the request ends), and ``release``.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal

import torch
import xgrammar as xgr

from bulkinfer.engine.structured_output.compile import compile_spec
from bulkinfer.engine.structured_output.compile_pool import CompilePool
from bulkinfer.engine.structured_output.spec import StructuredSpec

State = Literal["compiling", "ready", "failed"]

CACHE_SIZE = 256  # compiled grammars kept (least recently used evicted first)


@dataclass
class _Request:
    spec: StructuredSpec
    compiled: Future  # -> xgr.CompiledGrammar (shared with every request of the same key)
    deadline: float  # time.monotonic() by which the compile must be done
    matcher: xgr.GrammarMatcher | None = None
    error: str | None = None
    terminated: bool = False

    @property
    def grammar(self) -> xgr.GrammarMatcher:
        """The matcher, once compiled: what the bitmask and token steps use (after `_wait_ready`)."""
        assert self.matcher is not None, "the grammar is not compiled yet"
        return self.matcher


def fill_threads() -> int:
    """Threads for the per-step bitmask fill. Few: the fill runs between forward passes, while
    torch's own threads still hold the cores (on 2 CPUs, 2 fill threads measured slower than 1)."""
    return max(1, min(8, (os.cpu_count() or 1) // 4))


class StructuredOutputManager:
    def __init__(self, tokenizer: Any, vocab_size: int, max_num_seqs: int, compile_workers: int = 2,
                 compile_timeout_s: float = 30.0) -> None:
        # vocab_size is the model's (the logits' width): ids past the tokenizer's vocabulary are
        # padding, and xgrammar masks them out, so the bitmask covers every logit column.
        self.vocab_size = vocab_size
        self.compile_timeout_s = compile_timeout_s
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        # Our own cache below is the one that counts; xgrammar's would hold a second copy.
        self.compiler = xgr.GrammarCompiler(
            self.tokenizer_info, max_threads=compile_workers, cache_enabled=False
        )
        self._pool = CompilePool(compile_workers)
        self._cache: OrderedDict[StructuredSpec, Future] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._requests: dict[str, _Request] = {}
        self._bitmask = xgr.allocate_token_bitmask(max_num_seqs, vocab_size)
        self._batch = xgr.BatchGrammarMatcher(max_threads=fill_threads())
        self._last_rows: list[int] = []  # rows with a grammar in the last fill_bitmask
        self.num_compiles = 0  # grammars compiled (cache misses), for tests and metrics
        self.num_drafts_refused = 0  # draft tokens the grammar refused (speculative decoding)

    # ---- requests ------------------------------------------------------------------------------

    def register(self, request_id: str, spec: StructuredSpec) -> None:
        """Start compiling ``spec`` for this request (or reuse the compiled grammar of its key)."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} already has a grammar")
        self._requests[request_id] = _Request(
            spec=spec, compiled=self._compiled(spec), deadline=time.monotonic() + self.compile_timeout_s
        )

    def state(self, request_id: str) -> State:
        request = self._requests[request_id]
        if request.error is not None:
            return "failed"
        if request.matcher is not None:
            return "ready"
        if not request.compiled.done():
            if time.monotonic() < request.deadline:
                return "compiling"
            # The compile thread may go on; this request stops waiting for it.
            request.error = (f"grammar for {request.spec.kind_name} did not compile within "
                             f"{self.compile_timeout_s:g} s (compile_timeout_s)")
            return "failed"
        exc = request.compiled.exception()
        if exc is not None:
            request.error = str(exc)
            return "failed"
        request.matcher = xgr.GrammarMatcher(request.compiled.result())
        return "ready"

    def error(self, request_id: str) -> str | None:
        request = self._requests.get(request_id)
        return None if request is None else request.error

    def release(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    # ---- per step ------------------------------------------------------------------------------

    def fill_bitmask(
        self, request_ids: list[str | None], drafts_before: list[tuple[int, ...]] | None = None
    ) -> torch.Tensor | None:
        """One bitmask row per sampled row (None = no grammar: all tokens allowed).

        `drafts_before[row]` (speculative decoding): the draft tokens the row's position comes
        after. Such a row is filled with the grammar advanced through them, and every grammar is
        rolled back afterwards. A row after a draft the grammar refuses stays unconstrained: that
        draft cannot be sampled, so nothing after it is kept."""
        if len(request_ids) > self._bitmask.shape[0]:  # drafted positions: more rows than requests
            self._bitmask = xgr.allocate_token_bitmask(len(request_ids), self.vocab_size)
        depths = drafts_before or [()] * len(request_ids)
        by_depth: dict[int, list[tuple[int, _Request]]] = {}
        for row, request_id in enumerate(request_ids):
            request = self._requests.get(request_id) if request_id is not None else None
            if request is None or request_id is None:
                continue
            if request.matcher is None and self._wait_ready(request_id) != "ready":
                continue  # failed: the engine finishes it; its row stays unconstrained
            by_depth.setdefault(len(depths[row]), []).append((row, request))
        if not by_depth:
            self._last_rows = []
            return None
        bitmask = self._bitmask[: len(request_ids)]
        bitmask.fill_(-1)  # all bits set: every token allowed
        advanced: dict[int, tuple[_Request, int]] = {}  # id(request) -> (request, drafts accepted)
        refused: set[int] = set()
        filled: list[int] = []
        for depth in sorted(by_depth):
            rows, matchers = [], []
            for row, request in by_depth[depth]:
                if depth and not self._advance_to(request, depths[row], advanced, refused):
                    continue
                if request.terminated:
                    continue
                rows.append(row)
                matchers.append(request.grammar)
            if rows:
                self._batch.batch_fill_next_token_bitmask(matchers, self._bitmask, indices=rows)
                filled += rows
        for request, num_accepted in advanced.values():
            request.grammar.rollback(num_accepted)
            request.terminated = request.grammar.is_terminated()
        self._last_rows = filled
        if not filled:
            return None
        return bitmask

    def _advance_to(self, request: _Request, drafts: tuple[int, ...],
                    advanced: dict[int, tuple[_Request, int]], refused: set[int]) -> bool:
        """Feed the request's grammar the drafts it has not taken yet; False once one is refused."""
        key = id(request)
        if key in refused:
            return False
        _, done = advanced.get(key, (request, 0))
        for token_id in drafts[done:]:
            if request.terminated or not request.grammar.accept_token(token_id):
                self.num_drafts_refused += 1
                refused.add(key)
                return False
            done += 1
            advanced[key] = (request, done)
            request.terminated = request.grammar.is_terminated()
        return True

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        """Disallowed tokens' logits become -inf, in place (only rows with a grammar are touched)."""
        rows = self._last_rows if bitmask.shape[0] == logits.shape[0] else None
        if logits.device.type == "cpu":
            xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=rows)
        else:
            xgr.apply_token_bitmask_inplace(
                logits, bitmask.to(logits.device, non_blocking=True), vocab_size=self.vocab_size,
                indices=rows, backend="torch_native",
            )

    def accept_token(self, request_id: str, token_id: int) -> bool:
        """Advance the request's grammar; False if the grammar rejects the token."""
        request = self._requests[request_id]
        if request.matcher is None or request.terminated:
            return False
        accepted = request.matcher.accept_token(token_id)
        request.terminated = request.matcher.is_terminated()
        return accepted

    def is_terminated(self, request_id: str) -> bool:
        request = self._requests.get(request_id)
        return request is not None and request.terminated

    def shutdown(self) -> None:
        self._pool.shutdown()

    # ---- compile cache -------------------------------------------------------------------------

    def _compiled(self, spec: StructuredSpec) -> Future:
        with self._cache_lock:
            future = self._cache.get(spec)
            if future is not None:
                self._cache.move_to_end(spec)
                return future
            future = self._pool.submit(self._compile, spec)
            self.num_compiles += 1
            self._cache[spec] = future
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)  # requests still hold their own future
            return future

    def _compile(self, spec: StructuredSpec) -> xgr.CompiledGrammar:
        """Runs in a compile thread (xgrammar releases the GIL). Tests override it."""
        return compile_spec(self.compiler, spec)

    def _wait_ready(self, request_id: str) -> State:
        """A request sampled before it was ready (the scheduler should not do this): wait out its
        compile here rather than let it run unconstrained."""
        request = self._requests[request_id]
        try:
            request.compiled.result(timeout=max(0.0, request.deadline - time.monotonic()))
        except Exception:  # noqa: BLE001 - the failure or timeout is reported by state()
            pass
        return self.state(request_id)
