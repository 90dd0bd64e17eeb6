"""The scheduler: which requests run this step, and how many tokens each computes.

One rule: each step, every request's computed tokens catch up with its known tokens
(`len(all_token_ids)`) as far as the token budget (`max_num_batched_tokens`), `max_num_seqs` and
the KV pool allow. Prefill, chunked prefill, decode and recompute after preemption all follow
from it. Running requests are served first, in order; then waiting ones are admitted.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from bulkinfer.engine.config import EngineConfig
from bulkinfer.engine.errors import ErrorKind
from bulkinfer.engine.kv_cache_manager import KVCacheManager
from bulkinfer.engine.kv_connector.connector import NOTHING, KVConnector, KVLoad, LoadDecision
from bulkinfer.engine.lora.admission import LoRAAdmission
from bulkinfer.engine.multimodal.encoder_cache import EncoderCache
from bulkinfer.engine.prefix_hash import BlockHash
from bulkinfer.engine.request import FinishReason, Request, RequestStatus


@dataclass(slots=True, eq=False)  # not frozen: a frozen init costs 4x, for every row of every step
class ScheduledChunk:
    """One request's work in a step, fixed when it was scheduled (vLLM's NewRequestData /
    CachedRequestData): what the runner computes does not move when the request is updated.
    Never changed after it is made."""

    request: Request  # for its token ids and sampling state
    start: int  # the first token computed this step (num_computed_tokens when scheduled)
    num_new_tokens: int
    # True when the chunk catches the request up with every known token, so the forward pass
    # yields its next token; False for a partial (chunked) prefill.
    samples: bool
    # The request's whole block table after this step's allocation: its live list (not a copy per
    # row per step), read when the step is prepared, before anything schedules again.
    block_ids: Sequence[int]
    # Draft tokens (speculative decoding) computed after the request's last known token; the
    # last len + 1 positions are verified. Counted in num_new_tokens.
    spec_token_ids: tuple[int, ...] = ()
    epoch: int = 0  # the request's spec_epoch when scheduled

    @classmethod
    def of(
        cls, request: Request, num_new_tokens: int, spec_token_ids: tuple[int, ...] = ()
    ) -> ScheduledChunk:
        """The chunk of `num_new_tokens` (drafts included) from where the request stands now."""
        start = request.num_computed_tokens
        num_known = num_new_tokens - len(spec_token_ids)
        return cls(request, start, num_new_tokens, start + num_known == request.num_tokens_incl_placeholders,
                   request.block_ids, spec_token_ids, request.spec_epoch)

    @property
    def void(self) -> bool:
        """Built on drafts a step before it rejected (async scheduling): its rows are not the request's."""
        return self.epoch != self.request.spec_epoch

    @property
    def num_sample_rows(self) -> int:
        """Positions whose logits the step needs: the last known token and each draft."""
        return 1 + len(self.spec_token_ids) if self.samples else 0


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)  # running first, then newly admitted
    num_scheduled_tokens: int = 0
    preempted_ids: list[str] = field(default_factory=list)
    # Prefix blocks fetched from the KV store, copied into their blocks before the forward pass.
    kv_loads: list[KVLoad] = field(default_factory=list)
    # Hashes of the full blocks this step computes or loads (cached once its outputs are taken): a
    # waiting request whose first uncached block is among them waits a step and then hits it.
    blocks_in_flight: set[BlockHash] = field(default_factory=set)


class _FcfsQueue:
    """Arrival order; preempted requests go back to the front. Aborted entries are skipped lazily."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()
        self._num_live = 0

    def __len__(self) -> int:
        return self._num_live

    def push(self, request: Request) -> None:
        self._queue.append(request)
        self._num_live += 1

    def push_front(self, requests: Iterable[Request]) -> None:
        """Put `requests` back at the front, keeping their order."""
        requests = list(requests)
        self._queue.extendleft(reversed(requests))
        self._num_live += len(requests)

    def peek(self) -> Request:
        while self._queue[0].is_finished:  # aborted while waiting
            self._queue.popleft()
        return self._queue[0]

    def pop(self) -> Request:
        request = self.peek()
        self._queue.popleft()
        self._num_live -= 1
        return request

    def discard(self, request: Request) -> None:
        """Forget a waiting request that is being finished (its entry is dropped when reached)."""
        self._num_live -= 1

    def __iter__(self) -> Iterator[Request]:
        return (request for request in self._queue if not request.is_finished)


class _PriorityQueue:
    """Lowest `priority` first, then earliest arrival. Preempted requests re-enter by their priority."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._tiebreak = itertools.count()
        self._num_live = 0

    def __len__(self) -> int:
        return self._num_live

    def push(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time, next(self._tiebreak), request))
        self._num_live += 1

    def push_front(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.push(request)

    def peek(self) -> Request:
        while self._heap[0][-1].is_finished:
            heapq.heappop(self._heap)
        return self._heap[0][-1]

    def pop(self) -> Request:
        request = self.peek()
        heapq.heappop(self._heap)
        self._num_live -= 1
        return request

    def discard(self, request: Request) -> None:
        self._num_live -= 1

    def __iter__(self) -> Iterator[Request]:  # heap order, not priority order
        return (entry[-1] for entry in self._heap if not entry[-1].is_finished)


def _is_decode(request: Request) -> bool:
    """One token left to compute: a decode (or a finished prefill's first sample), not a prompt chunk."""
    return request.num_tokens_incl_placeholders - request.num_computed_tokens <= 1


class _StepBudget:
    """What one schedule() call has handed out so far."""

    def __init__(self, token_budget: int) -> None:
        self.token_budget = token_budget
        self.output = SchedulerOutput()
        self.encoded_images: set[str] = set()  # digests whose encoder work this step is charged

    def add(self, request: Request, num_new_tokens: int, spec_token_ids: tuple[int, ...] = ()) -> None:
        self.output.chunks.append(ScheduledChunk.of(request, num_new_tokens, spec_token_ids))
        self.output.num_scheduled_tokens += num_new_tokens
        self.token_budget -= num_new_tokens


class Scheduler:
    """Waiting and running queues, the token budget, chunked prefill, preemption, prefix sharing.

    Use: `add_request` any time; per step `output = schedule()`, run the model on `output`, then
    `finished = update_from_output(output, sampled)`. `abort_request` between steps.

    `max_model_len` here is the effective limit: `config.max_model_len` (the engine resolves None
    to the model's limit first; None here means no model limit), further capped at what the whole
    KV pool can hold (capacity + 1 tokens, the last sampled token needs no slot), so a request
    running alone always fits and preemption can never livelock.
    """

    def __init__(self, config: EngineConfig, num_kv_blocks: int,
                 eos_token_id: int | Sequence[int] | None, sliding_window: int | None = None,
                 model_key: str | None = None) -> None:
        """`model_key`: what block hashes say of the model (default: `config.model`, its folder);
        with a KV store, the weights' identity, so workers with other folders share blocks."""
        self.config = config  # validated by its owner (LLMEngine), once
        # Every id that ends a sequence (Llama 3 instruct has two: <|end_of_text|>, <|eot_id|>).
        self.eos_token_ids = eos_id_set(eos_token_id)
        # sliding_window: where every layer slides, blocks behind it are freed (kv_cache_manager).
        self.kv_cache_manager = KVCacheManager(
            num_kv_blocks, config.block_size, config.enable_prefix_caching,
            hash_extra_keys=(model_key or config.model,),
            sliding_window=sliding_window,
            cache_generated_blocks=not config.batch_invariant_on,
        )
        pool_limit = self.kv_cache_manager.capacity_tokens + 1
        self.max_model_len = min(config.max_model_len or pool_limit, pool_limit)
        self.waiting: _FcfsQueue | _PriorityQueue = (
            _PriorityQueue() if config.scheduling_policy == "priority" else _FcfsQueue()
        )
        # FCFS: admission order. Priority: sorted by (priority, arrival), so the last is the victim.
        self.running: list[Request] = []
        self._requests: dict[str, Request] = {}  # every unfinished request
        self.num_preemptions = 0
        # Set by the engine: False for a waiting request that may not start yet (its grammar is
        # still compiling). It is skipped, keeping its place, and the requests behind it run.
        self.can_admit: Callable[[Request], bool] | None = None
        # A model that takes images: encoder outputs already computed (their work is not charged again).
        self.encoder_cache: EncoderCache | None = None
        # At most max_loras adapters among running requests (engine/lora/admission.py).
        self.lora_admission = LoRAAdmission(config.max_loras) if config.enable_lora else None
        # Set by the engine with a KV store: prefix blocks fetched from it (engine/kv_connector/).
        self.kv_connector: KVConnector | None = None
        # Full blocks the step launched ahead of its outputs computes or loads (async scheduling:
        # commit_in_flight), until its outputs are taken.
        self._committed_blocks: set[BlockHash] = set()
        # Async scheduling: the chunks of the step in flight (a row it finishes still holds its
        # adapter's slot until the step is taken).
        self._in_flight_chunks: list[ScheduledChunk] = []

    # ---- requests in and out -------------------------------------------------------------------

    def add_request(self, request: Request) -> bool:
        """Queue a new request. Returns True when queued.

        Returns False when the request is invalid (empty prompt, bad token id, prompt too long
        for max_model_len or for the KV pool, bad SamplingParams): it is then already finished,
        with `finish_reason == FinishReason.ERROR` and `request.error` saying why; the scheduler
        keeps no trace of it, so the caller reports it itself (it will not come out of
        `update_from_output`). Raises ValueError only for caller bugs: a duplicate live
        request_id, or a request that is not fresh.
        """
        if request.request_id in self._requests:
            raise ValueError(f"request_id {request.request_id!r} is already in the scheduler")
        is_fresh = request.status is RequestStatus.WAITING and not request.output_token_ids
        if not is_fresh or request.num_computed_tokens:
            raise ValueError(f"request {request.request_id!r} is not fresh (status {request.status.name})")
        rejection = self._validation_error(request)
        if rejection is not None:
            kind, error = rejection
            request.finish(FinishReason.ERROR, time.monotonic(), error=error, kind=kind)
            return False
        self._requests[request.request_id] = request
        self.waiting.push(request)
        if self.kv_connector is not None:
            self.kv_connector.add_request(self.kv_cache_manager.block_hashes(request))
        return True

    def abort_request(self, request_id: str) -> Request | None:
        """Finish an unfinished request with `abort` and free its blocks (full ones stay cached).

        Returns the request, or None if no unfinished request has this id. Aborted requests are
        not returned by `update_from_output`.
        """
        return self.finish_request(request_id, FinishReason.ABORT)

    def finish_request(
        self, request_id: str, reason: FinishReason, error: str | None = None, kind: ErrorKind | None = None
    ) -> Request | None:
        """Finish an unfinished request (waiting or running) from outside `update_from_output` —
        a stop string, a completed or failed grammar, an abort — and free its blocks (full ones
        stay cached). Returns the request, or None if no unfinished request has this id; it is
        not returned by `update_from_output`.
        """
        request = self._requests.get(request_id)
        if request is None:
            return None
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)  # O(n), but only for the few requests that end this way
        else:
            self.waiting.discard(request)
        self._finish(request, reason, time.monotonic(), error, kind)
        return request

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    # ---- stats --------------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_cache_manager.usage

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    # ---- one step -----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick this step's chunks: running requests first (preempting when blocks run out),
        then waiting ones, unless this step preempted. While prompts fill whole steps (a batch
        just submitted), running decodes sit those steps out (`_prefill_only_step`)."""
        step = _StepBudget(self.config.max_num_batched_tokens)
        prefill_only = self._prefill_only_step()
        self._schedule_running(step, with_decodes=not prefill_only)
        if not step.output.preempted_ids:
            self._schedule_waiting(step)
        if prefill_only and not step.output.chunks and not step.output.preempted_ids:
            # Nothing could be admitted after all (e.g. grammars still compiling): a normal step.
            self._schedule_running(step)
            if not step.output.preempted_ids:
                self._schedule_waiting(step)
        return step.output

    def _prefill_only_step(self) -> bool:
        """Whether this step carries prefill chunks only, the running decodes waiting a step.

        Throughput, not latency, is a batch's measure: a decode riding along a prefill chunk costs
        more than in a decode step (its rows go through the per-layer path, and on CPU its
        projections run twice, by the chunk's GEMM and by the row kernel that keeps a row's bits
        independent of its step), and it gains nothing from the chunk's weights pass. So while
        prompts waiting (or part-way through their prefill) fill a whole step, those steps are
        prefill only, as vLLM's scheduler did before chunked prefill: a submitted batch prefills
        first and then decodes in full native steps (SmolLM2 on the 2-core Xeon, unique and mixed
        workloads: 2-4% less wall time). Never when a waiting request is less urgent than a
        running decode (priority policy), nor when free KV blocks are short: every running or admitted
        request keeps one block of headroom, so admitting prompts does not force decodes to preempt."""
        if not self.waiting or len(self.running) >= self.config.max_num_seqs:
            return False
        decodes = [r for r in self.running if _is_decode(r)]
        if not decodes:
            return False  # nothing to hold back: the normal step is the same
        if self.config.scheduling_policy == "priority" and \
                self.waiting.peek().priority > min(r.priority for r in decodes):
            return False
        budget = self.config.max_num_batched_tokens
        pending = sum(r.num_tokens - r.num_computed_tokens for r in self.running if not _is_decode(r))
        admitted = 0  # about how many waiting requests this step would admit
        for request in self.waiting:
            if pending >= budget:
                break
            pending += request.num_tokens - request.num_computed_tokens
            admitted += 1
        if pending < budget:
            return False
        # The step's prompt blocks (a partial one each), then a block for every request's next token.
        headroom = -(-budget // self.config.block_size) + len(self.running) + 2 * admitted
        return self.kv_cache_manager.num_free_blocks >= headroom + self._growth_reserve()

    def commit_in_flight(self, output: SchedulerOutput) -> None:
        """Async scheduling: a launched step's tokens count as computed now, and each sampling
        chunk's coming tokens as placeholders (its next token, and each draft it verifies: counted
        as accepted), so the next schedule() runs while this step is on the device. Its
        `update_from_output(..., committed=True)` then adds the tokens, and where drafts were
        rejected steps back to the tokens accepted (`spec_epoch`)."""
        # Blocks it computes or loads are cached when its outputs are taken, after the next schedule():
        # that one holds back requests waiting on them as it does for its own (then they hit them).
        self._committed_blocks = output.blocks_in_flight
        self._in_flight_chunks = output.chunks
        for chunk in output.chunks:
            request = chunk.request
            request.num_computed_tokens = chunk.start + chunk.num_new_tokens
            if chunk.samples:
                request.num_output_placeholders += chunk.num_sample_rows
                request.drafts_in_flight = chunk.spec_token_ids

    def update_from_output(
        self, output: SchedulerOutput, sampled: Mapping[str, int | Sequence[int]], committed: bool = False
    ) -> list[Request]:
        """Apply a finished forward pass. `sampled` maps each sampling chunk's request id to its
        new token, or to its new tokens when the chunk verified drafts (the accepted drafts, then
        the token sampled after them). Tokens are taken one at a time and stop as decoding one
        by one would: a stop on the i-th drops the rest. Returns the requests that finished
        this step (their blocks are already freed). `committed`: the step went through
        `commit_in_flight` (a request may have been preempted since: its token still counts)."""
        now = time.monotonic()
        finished: list[Request] = []
        if committed and self._committed_blocks is output.blocks_in_flight:
            self._committed_blocks = set()  # cached below: no later step waits on them
            self._in_flight_chunks = []
        for chunk in output.chunks:
            request = chunk.request
            if request.is_finished:  # aborted after schedule()
                continue
            if chunk.epoch != request.spec_epoch:  # void (`ScheduledChunk.void`), inlined: per row per step
                continue
            if chunk.samples and request.request_id not in sampled:
                raise ValueError(f"no sampled token for request {request.request_id!r}, whose chunk samples")
            if not committed:
                request.num_computed_tokens = chunk.start + chunk.num_new_tokens - len(chunk.spec_token_ids)
            elif chunk.samples:
                request.num_output_placeholders -= 1 + len(chunk.spec_token_ids)
            if chunk.samples and request.sampling_params.max_tokens == 0:
                # Score only: the prompt is computed (its logprobs taken); no token is generated.
                self._finish_from_output(request, FinishReason.LENGTH, now)
                finished.append(request)
                continue
            if chunk.samples:
                new_tokens = sampled[request.request_id]
                token_ids = [new_tokens] if isinstance(new_tokens, int) else new_tokens
                if len(token_ids) > len(chunk.spec_token_ids) + 1:
                    raise ValueError(f"{len(token_ids)} tokens for request {request.request_id!r}, "
                                     f"which verified {len(chunk.spec_token_ids)} drafts")
                reason = None
                for index, token_id in enumerate(token_ids):
                    # An accepted draft's KV was written by this step: it counts as computed
                    # (committed: all its drafts were counted at launch).
                    request.num_computed_tokens += 1 if index and not committed else 0
                    request.append_output_token(token_id, now)
                    reason = self._stop_reason(request, token_id)
                    if reason is not None:
                        break
                if reason is not None:
                    self._finish_from_output(request, reason, now)
                    finished.append(request)
                    continue
                if chunk.spec_token_ids:
                    if committed and len(token_ids) <= len(chunk.spec_token_ids):  # a draft rejected
                        self._step_back(request, chunk.start + len(token_ids))
                    self.kv_cache_manager.trim(request)  # rejected drafts' slots go back to the pool
            self.kv_cache_manager.cache_blocks(request)
        if finished:
            self.running = [request for request in self.running if not request.is_finished]
        return finished

    @staticmethod
    def _step_back(request: Request, num_valid: int) -> None:
        """Drafts of a step that ran ahead were rejected: the request's KV is valid for its first
        `num_valid` tokens only (never more than computed: it may have been preempted since), and
        a step launched after this one continued from the rejected drafts: its chunk is void."""
        request.num_computed_tokens = min(request.num_computed_tokens, num_valid)
        if request.num_output_placeholders:
            request.spec_epoch += 1
            request.num_output_placeholders = 0

    def _finish_from_output(self, request: Request, reason: FinishReason, now: float) -> None:
        if request.status is not RequestStatus.RUNNING:  # preempted after its step was launched
            self.waiting.discard(request)
        self._finish(request, reason, now)

    # ---- internals ----------------------------------------------------------------------------

    def _schedule_running(self, step: _StepBudget, with_decodes: bool = True) -> None:
        index = 0
        while index < len(self.running) and step.token_budget > 0:
            request = self.running[index]
            if not with_decodes and _is_decode(request):
                index += 1
                continue
            if request.num_output_placeholders and self._ends_in_flight(request):
                index += 1  # its last token is being sampled: nothing more to compute
                continue
            num_new = min(request.num_tokens_incl_placeholders - request.num_computed_tokens,
                          step.token_budget)
            if request.mm_items and request.num_computed_tokens < request.num_prompt_tokens:
                num_new = self._fit_encoder_work(request, request.num_computed_tokens, num_new, step)
            spec = self._drafts_that_fit(request, num_new, step.token_budget) \
                if request.spec_token_ids else ()
            if spec and self.kv_cache_manager.allocate_slots(request, num_new + len(spec)) is None:
                spec = ()  # drafts never preempt anyone: verify nothing this step instead
            if not spec and not self._allocate_or_preempt(request, num_new, step):
                break  # the request preempted itself: it was the last one running
            if self.waiting:
                self._note_blocks_in_flight(request, num_new, step)
            step.add(request, num_new + len(spec), spec)
            index += 1

    def _fit_encoder_work(self, request: Request, start: int, num_new: int, step: _StepBudget) -> int:
        """Charge the encoder work of the chunk's images that are not cached (their encoder rows)
        to the step's budget; a chunk that is not the step's first stops before an image whose work
        does not fit, which then starts the next step's chunk."""
        cache = self.encoder_cache
        charged: set[str] = step.encoded_images
        for item in request.mm_items:
            if not (item.offset < start + num_new and item.end > start):
                continue
            if item.digest in charged or (cache is not None and item.digest in cache):
                continue
            if step.output.chunks and item.offset > start and num_new + item.num_embeds > step.token_budget:
                return item.offset - start
            charged.add(item.digest)
            step.token_budget -= item.num_embeds
        return num_new

    def _ends_in_flight(self, request: Request) -> bool:
        """Whether the tokens still being sampled for the request take it to max_tokens or
        max_model_len (async scheduling: no step is scheduled past its end)."""
        coming = request.num_output_placeholders
        return (request.num_output_tokens + coming >= request.sampling_params.max_tokens
                or request.num_tokens + coming >= self.max_model_len)

    def _drafts_that_fit(self, request: Request, num_new: int, token_budget: int) -> tuple[int, ...]:
        """The request's drafts (`request.spec_token_ids`, set by the engine) this step verifies:
        only for a decode, and no more than the token budget, max_tokens and max_model_len leave
        room for (verifying k drafts can emit k + 1 tokens)."""
        drafts = request.spec_token_ids
        coming = request.num_output_placeholders  # a step in flight counts its drafts accepted
        known = request.num_tokens + coming
        if not drafts or num_new != 1 or request.num_computed_tokens + 1 != known:
            return ()
        room = min(
            len(drafts),
            token_budget - 1,
            request.sampling_params.max_tokens - request.num_output_tokens - coming - 1,
            self.max_model_len - known - 1,
        )
        return tuple(drafts[:room]) if room > 0 else ()

    def _allocate_or_preempt(self, request: Request, num_new: int, step: _StepBudget) -> bool:
        """Allocate, preempting from the back of `running` until it fits. False if `request`
        itself had to go. The victims come after `request`, so none was scheduled this step."""
        while self.kv_cache_manager.allocate_slots(request, num_new) is None:  # [] when none are needed
            victim = self.running.pop()
            self._preempt(victim, step)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request, step: _StepBudget) -> None:
        # free() caches the full computed blocks first, so the recompute hits them.
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push_front([request])
        step.output.preempted_ids.append(request.request_id)

    def _growth_blocks(self, request: Request, num_held: int) -> int:
        """Blocks the request still needs, beyond the `num_held` it holds, for the rest of its
        prompt and its next `kv_growth_reserve_tokens`.

        Why: a request admitted into room its running neighbours will need pushes one of them out
        later, whose whole context (prompt and output so far) is then computed again, as much work
        as its prefill (SmolLM2 fp32, 256 rows of 450 tokens + 64 out in a 4 GiB cache: 24
        preempted, about 11,500 tokens recomputed). Room for every request's whole output would
        hold too much back where max_tokens is a loose cap (4,096 on answers of 200); a window
        covers short outputs whole and keeps long ones off the edge."""
        reserve = self.config.kv_growth_reserve_tokens
        if not reserve:
            return 0
        end = min(request.num_prompt_tokens + request.sampling_params.max_tokens,
                  request.num_tokens + reserve, self.max_model_len)
        return max(0, -(-end // self.config.block_size) - num_held)

    def _growth_reserve(self, priority: int | None = None) -> int:
        """Free blocks the running requests' growth will take (`_growth_blocks` of each). With
        `priority` (the priority policy, for a request of that priority): only the growth of those
        at least as urgent, less the blocks the less urgent ones hold, which preemption gives to
        the more urgent (so the result may be negative)."""
        if not self.config.kv_growth_reserve_tokens:
            return 0
        if priority is None:
            return sum(self._growth_blocks(request, len(request.block_ids)) for request in self.running)
        return sum(self._growth_blocks(request, len(request.block_ids)) if request.priority <= priority
                   else -self.kv_cache_manager.num_held_blocks(request) for request in self.running)

    def _schedule_waiting(self, step: _StepBudget) -> None:
        set_aside: list[Request] = []  # held back or not admissible yet, in queue order
        num_held_back = num_skipped = 0
        by_priority = self.config.scheduling_policy == "priority"
        # FCFS: the running requests' growth, counted once, then kept up as requests are admitted.
        # The priority policy counts it per waiting request instead (it depends on its priority).
        reserve = self._growth_reserve() if self.waiting and not by_priority else 0
        # Bound the lookups per step when many waiting requests share one prefix or wait on a grammar.
        max_held_back = self.config.max_num_seqs
        max_skipped = 4 * self.config.max_num_seqs
        lora = self.lora_admission
        if lora is not None:
            running = {id(request) for request in self.running}
            # The step in flight's rows hold their adapters' slots until it is taken, ended or not.
            lora.begin([*self.running, *(chunk.request for chunk in self._in_flight_chunks
                                         if id(chunk.request) not in running)])
        while self.waiting and step.token_budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            if self.can_admit is not None and not self.can_admit(request):
                set_aside.append(self.waiting.pop())
                num_skipped += 1
                if num_skipped >= max_skipped:
                    break
                continue
            if lora is not None and not lora.admits(request):
                set_aside.append(self.waiting.pop())
                num_skipped += 1
                if num_skipped >= max_skipped:
                    break
                continue
            computed_blocks, num_computed = self.kv_cache_manager.get_computed_blocks(request)
            if self._first_uncached_block_in_flight(request, len(computed_blocks), step):
                set_aside.append(self.waiting.pop())
                num_held_back += 1
                if num_held_back >= max_held_back:
                    break
                continue
            loads = self._kv_store_lookup(request, len(computed_blocks))
            if loads.wait:  # its prefix is being fetched: the requests behind it go on
                set_aside.append(self.waiting.pop())
                num_skipped += 1
                if num_skipped >= max_skipped:
                    break
                continue
            num_loaded = len(loads.blocks) * self.config.block_size
            # chunked prefill
            num_new = min(request.num_tokens - num_computed - num_loaded, step.token_budget)
            if request.mm_items:
                num_new = self._fit_encoder_work(request, num_computed + num_loaded, num_new, step)
            growth = self._growth_blocks(request, len(computed_blocks) + len(loads.blocks))
            spoken_for = self._growth_reserve(request.priority) if by_priority else reserve
            if self.running and growth + spoken_for > self.kv_cache_manager.num_free_blocks:
                break  # the running requests will need the room: wait for some to finish
            if self.kv_cache_manager.allocate_slots(request, num_loaded + num_new, computed_blocks) is None:
                break  # out of blocks: wait for running requests to finish
            self.waiting.pop()
            self._admit(request, num_computed + num_loaded)
            if loads.blocks:
                self._take_loads(request, len(computed_blocks), loads, step)
            if lora is not None:
                lora.admitted(request)
            if not by_priority:
                reserve += self._growth_blocks(request, len(request.block_ids))
            self._note_blocks_in_flight(request, num_new, step)
            step.add(request, num_new)
        self.waiting.push_front(set_aside)

    def _kv_store_lookup(self, request: Request, num_local_blocks: int) -> LoadDecision:
        if self.kv_connector is None:
            return NOTHING
        return self.kv_connector.lookup(request.request_id, self.kv_cache_manager.block_hashes(request),
                                        num_local_blocks, self.kv_cache_manager.max_hit_blocks(request))

    def _take_loads(self, request: Request, first: int, loads: LoadDecision, step: _StepBudget) -> None:
        """The admitted request's fetched blocks go into its blocks from `first` on, before this
        step's forward pass; requests waiting on the same prefix hold back a step, then hit it."""
        assert self.kv_connector is not None
        block_ids = tuple(request.block_ids[first: first + len(loads.blocks)])
        step.output.kv_loads.append(KVLoad(block_ids, loads.blocks))
        step.output.blocks_in_flight.update(loads.hashes)
        self.kv_connector.loaded(request.request_id)

    def _admit(self, request: Request, num_computed: int) -> None:
        if request.status is RequestStatus.WAITING:  # first admission, not a recompute
            request.num_cached_tokens = num_computed
            request.first_scheduled_time = time.monotonic()
        request.num_computed_tokens = num_computed
        request.status = RequestStatus.RUNNING
        if self.config.scheduling_policy == "priority":
            bisect.insort(self.running, request, key=lambda r: (r.priority, r.arrival_time))
        else:
            self.running.append(request)

    def _note_blocks_in_flight(self, request: Request, num_new: int, step: _StepBudget) -> None:
        """Record the hashes of full blocks this chunk computes (only needed if someone waits)."""
        if not self.config.enable_prefix_caching or not self.waiting:
            return
        block_size = self.config.block_size
        first_block = request.num_computed_tokens // block_size
        end_block = -(-(request.num_computed_tokens + num_new) // block_size)
        if first_block * block_size + block_size > request.num_tokens:
            return  # the chunk touches no full block (the common decode case): nothing to hash
        hashes = self.kv_cache_manager.block_hashes(request)
        step.output.blocks_in_flight.update(hashes[first_block:end_block])

    def _first_uncached_block_in_flight(
        self, request: Request, num_hit_blocks: int, step: _StepBudget
    ) -> bool:
        """Whether another chunk of this step, or of the step still in flight (async scheduling),
        computes the request's first uncached block. Only ever true when something else is
        scheduled or running, so holding back cannot stall."""
        if not (step.output.blocks_in_flight or self._committed_blocks) or request.needs_prompt_logprobs:
            return False  # a request scoring its prompt recomputes those blocks anyway
        hashes = self.kv_cache_manager.block_hashes(request)
        if num_hit_blocks >= len(hashes):
            return False
        first = hashes[num_hit_blocks]
        return first in step.output.blocks_in_flight or first in self._committed_blocks

    def _stop_reason(self, request: Request, token_id: int) -> FinishReason | None:
        params = request.sampling_params
        if request.num_output_tokens <= params.min_tokens:  # the sampler masks stops until then
            return self._length_reason(request)
        if params.stop_token_ids and token_id in params.stop_token_ids:
            request.stop_reason = token_id
            request.stopped_on_token = True
            return FinishReason.STOP
        if token_id in self.eos_token_ids and not params.ignore_eos:
            request.stopped_on_token = True
            return FinishReason.STOP
        return self._length_reason(request)

    def _length_reason(self, request: Request) -> FinishReason | None:
        if (
            request.num_output_tokens >= request.sampling_params.max_tokens
            or request.num_tokens >= self.max_model_len
        ):
            return FinishReason.LENGTH
        return None

    def _finish(self, request: Request, reason: FinishReason, now: float, error: str | None = None,
                kind: ErrorKind | None = None) -> None:
        """Mark finished and free its blocks; the caller removes it from `running`."""
        request.finish(reason, now, error, kind)
        self.kv_cache_manager.free(request)
        if self.kv_connector is not None:
            self.kv_connector.request_finished(request.request_id)
        del self._requests[request.request_id]

    def _validation_error(self, request: Request) -> tuple[ErrorKind, str] | None:
        """Why the scheduler cannot take this request, as (kind, message). Its SamplingParams are
        the caller's to validate (LLMEngine.add_request does, once)."""
        num_prompt = request.num_prompt_tokens
        if num_prompt == 0:
            return ErrorKind.EMPTY_PROMPT, "prompt is empty"
        lowest = min(request.prompt_token_ids)
        if lowest < 0:
            return ErrorKind.INVALID_PROMPT, f"prompt holds a negative token id: {lowest}"
        if self.config.max_model_len is not None and num_prompt + 1 > self.config.max_model_len:
            return ErrorKind.PROMPT_TOO_LONG, (
                f"prompt has {num_prompt} tokens; with at least one generated token that exceeds "
                f"max_model_len={self.config.max_model_len}"
            )
        if num_prompt + 1 > self.max_model_len:
            return ErrorKind.PROMPT_TOO_LONG, (
                f"prompt has {num_prompt} tokens but the KV cache holds only "
                f"{self.kv_cache_manager.capacity_tokens} tokens in all"
            )
        return None


def eos_id_set(eos: int | Sequence[int] | None) -> frozenset[int]:
    """One EOS id, several, or none, as a set."""
    if eos is None:
        return frozenset()
    return frozenset([eos]) if isinstance(eos, int) else frozenset(eos)
