"""The engine's structured-output bookkeeping: which live samples have a grammar, which grammars still
compile, and the ``StructuredOutputManager`` that holds them.

The manager (and with it xgrammar) is built only when the first structured request arrives, so an
engine that never sees one never imports xgrammar. The tracker knows request ids, not the scheduler:
it tells the engine which requests to finish and why.
"""

from __future__ import annotations

from typing import Any

import torch

from bulkinfer.engine.request import FinishReason, Request
from bulkinfer.engine.sampling_params import STRUCTURED_FIELDS, SamplingParams


class GrammarTracker:
    """Grammars of the engine's live samples, by scheduler request id."""

    def __init__(self, tokenizer: Any, vocab_size: int, max_num_seqs: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._max_num_seqs = max_num_seqs
        self.manager: Any = None  # StructuredOutputManager, built on the first structured request
        self.ids: set[str] = set()  # live samples with a grammar
        self.compiling: set[str] = set()  # of those, the ones whose grammar is not ready yet

    def spec(self, params: SamplingParams) -> tuple[Any, str | None]:
        """The request's spec, with the manager built on first use; an error if xgrammar is missing."""
        if all(getattr(params, name) is None for name in STRUCTURED_FIELDS):
            return None, None
        try:
            spec = params.structured
            self.ensure_manager()
        except ImportError as exc:
            return None, f"structured output needs xgrammar (the worker extra): {exc}"
        return spec, None

    def ensure_manager(self) -> Any:
        """The ``StructuredOutputManager``, built (importing xgrammar) on the first call."""
        if self.manager is None:
            from bulkinfer.engine.structured_output import StructuredOutputManager  # xgrammar: only when used

            self.manager = StructuredOutputManager(self._tokenizer, self._vocab_size, self._max_num_seqs)
        return self.manager

    def register(self, request_ids: list[str], spec: Any) -> None:
        """Start compiling ``spec`` for these samples; they wait in the scheduler until it is ready."""
        manager = self.ensure_manager()
        for request_id in request_ids:
            manager.register(request_id, spec)
            self.ids.add(request_id)
            self.compiling.add(request_id)

    def can_admit(self, request: Request) -> bool:
        """The scheduler's admission hook: a request whose grammar still compiles waits."""
        return request.request_id not in self.compiling

    def poll(self) -> list[tuple[str, str]]:
        """Ids and errors of the requests whose grammar failed to compile; ready ones may start."""
        failed: list[tuple[str, str]] = []
        for request_id in list(self.compiling):
            state = self.manager.state(request_id)
            if state == "compiling":
                continue
            self.compiling.discard(request_id)
            if state == "failed":
                reason = self.manager.error(request_id) or "the grammar failed to compile"
                failed.append((request_id, f"structured output: {reason}"))
        return failed

    def bitmask(
        self, request_ids: list[str], drafts_before: list[tuple[int, ...]] | None = None
    ) -> tuple[torch.Tensor | None, Any]:
        """The step's token bitmask (one row per sampled position; `drafts_before[row]`: the
        drafts that position follows) and the function applying it; ``(None, None)`` when no
        live sample has a grammar."""
        if not self.ids:
            return None, None
        ids = [request_id if request_id in self.ids else None for request_id in request_ids]
        bitmask = self.manager.fill_bitmask(ids, drafts_before)
        return bitmask, self.manager.apply_bitmask if bitmask is not None else None

    def advance(self, request_id: str, token_id: int) -> tuple[FinishReason, str | None] | None:
        """Feed the sampled token to the grammar; how the request ends, if it does."""
        if not self.manager.accept_token(request_id, token_id):
            return FinishReason.ERROR, f"structured output: the grammar rejected token {token_id}"
        if self.manager.is_terminated(request_id):
            return FinishReason.STOP, None
        return None

    def release(self, request_id: str) -> None:
        """Forget a finished sample's grammar."""
        self.compiling.discard(request_id)
        self.ids.discard(request_id)
        self.manager.release(request_id)
