"""The engine's speculative decoding: who proposes drafts each step, the proposals, the outcome.

Per step: `plan` lets the gate decide, `before_schedule` sets each decoding request's drafts (n-gram:
the lookup itself; draft model: how many it wants, filled in once scheduled); the scheduler fits
them into the token budget and KV pool; `after_schedule` runs the draft model for the chunks that
verify; the engine verifies (engine/speculative/verify.py) and reports each outcome to `record`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from bulkinfer.engine.request import Request
from bulkinfer.engine.scheduler import SchedulerOutput
from bulkinfer.engine.speculative.config import SpeculativeConfig
from bulkinfer.engine.speculative.draft_model import DraftModel
from bulkinfer.engine.speculative.gate import SpeculationGate
from bulkinfer.engine.speculative.ngram import TokenArrays, propose_ngram
from bulkinfer.engine.speculative.stats import SpeculationStats


class Speculator:
    def __init__(self, config: SpeculativeConfig, gate: SpeculationGate, draft: DraftModel | None) -> None:
        if (config.method == "draft_model") != (draft is not None):
            raise ValueError("a draft model is needed exactly when method is 'draft_model'")
        self.config = config
        self.gate = gate
        self.draft = draft
        self.stats = SpeculationStats(config.num_speculative_tokens)
        self._marked: list[Request] = []
        self._tokens = TokenArrays()  # the n-gram lookup's view of each request's tokens

    def plan(self, num_running: int) -> int:
        """How many of the running requests may propose drafts this step (0: none): the gate's
        decision, made once per step (async scheduling asks before it takes the step in flight,
        which drafts must wait for)."""
        if not num_running:
            return 0
        budget = self.gate.proposers(num_running)
        if budget:
            self.stats.steps_on += 1
        else:
            self.stats.steps_off += 1
        return budget

    def before_schedule(self, running: list[Request], budget: int | None = None) -> None:
        """Set `spec_token_ids` on the running requests that decode and propose this step, at most
        `budget` of them (None: `plan` decides now)."""
        budget = self.plan(len(running)) if budget is None else budget
        if not budget or not running:
            return
        for request in running:
            if len(self._marked) >= budget:
                break
            coming = request.num_output_placeholders  # tokens a step in flight is sampling
            if request.num_computed_tokens + 1 != request.num_tokens + coming:
                continue  # still prefilling
            wanted = min(self.gate.num_drafts(request.request_id),
                         request.sampling_params.max_tokens - request.num_output_tokens - coming - 1)
            if wanted < 1:
                continue
            if self.draft is None:
                drafts = self._ngram(request, wanted)
            else:
                drafts = [0] * wanted  # placeholders: the draft model fills the scheduled ones
            if drafts:
                request.spec_token_ids = drafts
                self._marked.append(request)

    def _ngram(self, request: Request, wanted: int) -> list[int]:
        """The lookup's drafts. With a step in flight (async scheduling) the request's last token
        is not known yet: the lookup continues from the drafts that step verifies (as if accepted)
        and its first token, a guess at that unknown one, is dropped."""
        config = self.config
        tokens = self._tokens.of(request.request_id, request.all_token_ids)
        if not request.num_output_placeholders:
            return propose_ngram(tokens, wanted, config.prompt_lookup_min, config.prompt_lookup_max)
        if request.drafts_in_flight:
            tokens = np.concatenate([tokens, np.asarray(request.drafts_in_flight, dtype=tokens.dtype)])
        return propose_ngram(tokens, wanted + 1, config.prompt_lookup_min, config.prompt_lookup_max)[1:]

    def after_schedule(self, output: SchedulerOutput) -> None:
        """Clear the proposals; with a draft model, decode the drafts of the chunks that verify."""
        for request in self._marked:
            request.spec_token_ids = []
        self._marked = []
        if self.draft is None:
            return
        indices = [i for i, chunk in enumerate(output.chunks) if chunk.spec_token_ids]
        if not indices:
            return
        work = [(output.chunks[i].request, output.chunks[i].block_ids, len(output.chunks[i].spec_token_ids))
                for i in indices]
        for i, drafts in zip(indices, self.draft.propose(work), strict=True):
            output.chunks[i] = dataclasses.replace(output.chunks[i], spec_token_ids=tuple(drafts))

    def record(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        self.gate.record(request_id, num_drafts, num_accepted)
        self.stats.record(num_drafts, num_accepted)

    def release(self, request_id: str) -> None:
        self.gate.release(request_id)
        self._tokens.release(request_id)
        if self.draft is not None:
            self.draft.release(request_id)

    def metrics(self) -> dict[str, Any]:
        return {
            **self.stats.snapshot(),
            "method": self.config.method,
            "num_speculative_tokens": self.config.num_speculative_tokens,
            "running_acceptance": self.gate.acceptance,
            "break_even_batch": self.gate.break_even_batch(),
            "cost_curve": self.gate.curve.as_dict() if self.gate.curve is not None else None,
        }
