"""One sequence's state as it moves through the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import numpy as np

from bulkinfer.engine.errors import ErrorKind
from bulkinfer.engine.lora.request import LoRARequest
from bulkinfer.engine.multimodal.inputs import MultiModalItem
from bulkinfer.engine.prefix_hash import BlockHash
from bulkinfer.engine.sampling_params import SamplingParams


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id, a stop string or a completed grammar
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"
    ERROR = "error"  # rejected; `Request.error` says why


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()  # back in the waiting queue, to be recomputed
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED_STATUSES


_FINISHED_STATUS_BY_REASON = {
    FinishReason.STOP: RequestStatus.FINISHED_STOPPED,
    FinishReason.LENGTH: RequestStatus.FINISHED_LENGTH,
    FinishReason.ABORT: RequestStatus.FINISHED_ABORTED,
    FinishReason.ERROR: RequestStatus.FINISHED_ERROR,
}
_FINISHED_STATUSES = frozenset(_FINISHED_STATUS_BY_REASON.values())


@dataclass(eq=False)  # identity equality: requests are compared and hashed as objects
class Request:
    """A prompt, its generated tokens and the scheduler's bookkeeping.

    All times are `time.monotonic()` seconds. The scheduler sets `first_scheduled_time`,
    `token_times` and `finished_time`; metrics derive TTFT, ITL, TPOT and latency from them.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # lower value = scheduled first
    cache_salt: str | None = None
    # Randomness key: token t of this request is drawn from hash(sample_seed, sample_index, t)
    # (engine/sampling_random.py). The engine sets the seed at admission; sample_index is the
    # child's index when a prompt asks for n > 1 samples.
    sample_seed: int = 0
    sample_index: int = 0
    lora_request: LoRARequest | None = None  # the adapter its rows run with; None: the base model
    # The adapter's content digest (set by LLMEngine when it loads the adapter): its KV blocks' key,
    # so replaced adapter files never match blocks of the old ones (engine/lora/identity.py).
    lora_digest: str | None = None
    # The prompt's images (engine/multimodal/inputs.py): their spans take encoder rows, not token embeddings.
    mm_items: tuple[MultiModalItem, ...] = ()
    # M-RoPE (Qwen2.5-VL): [3, prompt] rotary positions, and the shift after the prompt (None: the index).
    rope_positions: np.ndarray | None = None
    rope_delta: int = 0

    output_token_ids: list[int] = field(default_factory=list, init=False)
    all_token_ids: list[int] = field(init=False)  # prompt + output, appended in sync
    num_computed_tokens: int = field(default=0, init=False)  # tokens whose KV is in the cache
    # Async scheduling: tokens a step still on the device is sampling for this request. The next
    # step is scheduled as if they were known (its input is filled on the device).
    num_output_placeholders: int = field(default=0, init=False)
    num_cached_tokens: int = field(default=0, init=False)  # prompt tokens hit on first admission
    status: RequestStatus = field(default=RequestStatus.WAITING, init=False)
    finish_reason: FinishReason | None = field(default=None, init=False)
    error: str | None = field(default=None, init=False)
    error_kind: ErrorKind | None = field(default=None, init=False)  # set with `error`
    # What ended a STOP: the stop string or stop token id (None for EOS or a finished grammar).
    stop_reason: str | int | None = field(default=None, init=False)
    stopped_on_token: bool = field(default=False, init=False)  # EOS or a stop token id ended it
    num_preemptions: int = field(default=0, init=False)
    # prompt_logprobs: prompt positions whose logits were scored so far (position p scores prompt
    # token p + 1), kept across preemption so a recompute neither repeats nor skips one.
    num_prompt_logprobs: int = field(default=0, init=False)
    # Draft tokens to verify after the last known token in the next step (speculative decoding):
    # set by the engine before each schedule(); the scheduler may verify fewer.
    spec_token_ids: list[int] = field(default_factory=list, init=False)
    # Drafts this request verified / had accepted, by draft position (grown as needed).
    spec_drafted_per_position: list[int] = field(default_factory=list, init=False)
    spec_accepted_per_position: list[int] = field(default_factory=list, init=False)
    # Async scheduling with drafts: the drafts of the request's step in flight (valid while it has
    # placeholders), and an epoch bumped when a step rejects drafts that a step launched after it
    # built on: that later step's chunk (scheduled in an older epoch) is void.
    drafts_in_flight: tuple[int, ...] = field(default=(), init=False)
    spec_epoch: int = field(default=0, init=False)

    # Owned by the KVCacheManager: the block table and the chained hashes of full blocks.
    block_ids: list[int] = field(default_factory=list, init=False)
    block_hashes: list[BlockHash] = field(default_factory=list, init=False)

    first_scheduled_time: float | None = field(default=None, init=False)
    token_times: list[float] = field(default_factory=list, init=False)  # one per output token
    # Step time attributed to this request: each step's time split over its requests by tokens.
    engine_seconds: float = field(default=0.0, init=False)
    finished_time: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_incl_placeholders(self) -> int:
        """Known tokens and those still being sampled: what the scheduler catches up with."""
        return len(self.all_token_ids) + self.num_output_placeholders

    @property
    def is_finished(self) -> bool:
        return self.status in _FINISHED_STATUSES  # per row per step: one set lookup

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether prompt positions are still to be scored: only the first sample of a prompt
        scores it (its n - 1 siblings share the result)."""
        return (self.sampling_params.prompt_logprobs is not None and self.sample_index == 0
                and self.num_prompt_logprobs < self.num_prompt_tokens - 1)

    @property
    def first_token_time(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def last_token_time(self) -> float | None:
        return self.token_times[-1] if self.token_times else None

    def append_output_token(self, token_id: int, now: float) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self.token_times.append(now)

    def truncate_output(self, num_outputs: int) -> None:
        """Keep the first `num_outputs` output tokens (a stop found on an earlier token of a step
        that emitted several); what ended the request on a dropped token no longer applies."""
        if num_outputs >= self.num_output_tokens:
            return
        del self.output_token_ids[num_outputs:]
        del self.all_token_ids[self.num_prompt_tokens + num_outputs:]
        del self.token_times[num_outputs:]
        self.num_computed_tokens = min(self.num_computed_tokens, self.num_tokens)
        self.stopped_on_token = False
        self.stop_reason = None

    def finish(self, reason: FinishReason, now: float, error: str | None = None,
               kind: ErrorKind | None = None) -> None:
        """`error` says why in words, `kind` as a code (an error without one is an engine failure)."""
        self.status = _FINISHED_STATUS_BY_REASON[reason]
        self.finish_reason = reason
        self.error = error
        self.error_kind = (kind or ErrorKind.ENGINE_FAILURE) if error is not None else None
        self.finished_time = now
