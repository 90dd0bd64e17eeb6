"""`EmbedHost`: one long-lived `Embedder` in its own thread, fed by any number of threads.

The counterpart of `EngineHost` for embedding models. Callers submit inputs (texts or token ids);
the embed thread tokenizes them, embeds every distinct sequence once per pooling asked for
(identical inputs waiting together share one vector), in passes of about `batch_tokens` tokens that
take the highest-priority inputs first and, within a priority, the longest first, and answers each
input's future. Between passes it takes new commands, so an abort or a stop waits for one
pass at most. Nothing here touches the object store.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from bulkinfer.jobs.embedding import EmbedInput, Pooling
from bulkinfer.worker.hosts.model_host import AbortCommand, AddCommand, HostSubmission, ModelHost, WorkCommand

if TYPE_CHECKING:
    from bulkinfer.engine.dtype_choice import DtypeChoice
    from bulkinfer.engine.embedder import Embedder

logger = logging.getLogger(__name__)

Vector = list[float]
_Key = tuple[tuple[int, ...], Pooling | None, bool | None]  # a sequence and how it is pooled
DEFAULT_PASS_TOKENS = 4096  # tokens per call to the embedder (Embedder.batch_tokens when it says)


@dataclass(frozen=True)
class EmbedInputRequest:
    """One input to embed. Text is tokenized with the model's special tokens; ids are used as given."""

    value: EmbedInput
    truncate: bool = False
    pooling: Pooling | None = None  # None: the model's (Embedder.pooling_config)
    normalize: bool | None = None
    priority: int = 0  # lower runs sooner (the engine's convention, as EngineRequest's)
    max_length: int | None = None  # tokens at most (a job's limit within the model's; None: the model's)


@dataclass(frozen=True)
class EmbedResult:
    """One input's outcome: its vector (float32 values), or why it has none (`aborted`: stopped before
    it ran; `too_long`: past the model's maximum length without truncate; else `error` says)."""

    embedding: list[float] | None
    prompt_tokens: int
    error: str | None = None
    too_long: bool = False
    aborted: bool = False
    seconds: float = 0.0  # embedder time attributed to it


class EmbedSubmission(HostSubmission[EmbedResult]):
    """The inputs of one `submit` call: their results come back in the order they were given."""


class EmbedHost(ModelHost["Embedder", EmbedInputRequest, EmbedResult]):
    """Loads the embedder with `load_embedder()` in its own thread, then embeds what it is sent.

    Inputs may be submitted before it is ready: they wait. If loading fails, every waiting and later
    submission fails with `EngineUnavailable` carrying the reason (as `EngineHost`'s do).
    """

    noun = "embedder"
    thread_prefix = "embed"

    def __init__(self, load_embedder: Callable[[], Embedder], name: str = "embedder") -> None:
        super().__init__(load_embedder, name)
        self._tokenized: dict[str, tuple[int, ...]] = {}  # the embed thread's: pending inputs' sequences
        self.dtype_choice: DtypeChoice | None = None  # once loaded
        self.dimension: int | None = None  # the model's vector size, once loaded
        self.fixed_pooling: str | None = None  # the pooling its checkpoint fixes, once loaded (None: free)
        self.max_length: int | None = None  # tokens per input, special tokens included, once loaded
        # What a heartbeat reports (worker/process/status_server.py), written by the embed thread only.
        self._busy_s = 0.0
        self._tokens_computed = 0
        self._waiting = 0

    def submit(self, requests: Sequence[EmbedInputRequest]) -> EmbedSubmission:
        return EmbedSubmission(self, *self._queue(requests))

    def figures(self) -> dict[str, Any]:
        """The engine figures a heartbeat reads (`LLMEngine.get_metrics()`'s names): inputs waiting,
        seconds spent embedding and tokens embedded (the deployment's measured throughput)."""
        return {"num_running": 0, "num_waiting": self._waiting, "busy_time_s": self._busy_s,
                "prefill_tokens_computed": self._tokens_computed, "generation_tokens": 0}

    # ---- the embed thread ----------------------------------------------------------------------

    def _on_loaded(self, embedder: Embedder) -> None:
        self.dtype_choice = embedder.dtype_choice
        self.dimension = embedder.config.dimension
        self.max_length = embedder.config.max_length
        self.fixed_pooling = getattr(embedder, "fixed_pooling", None)
        self.device = str(getattr(embedder, "device", "cpu"))
        logger.info("embedder %s ready (dtype %s, %d dimensions, %d tokens at most)", self.name,
                    embedder.dtype_choice.dtype, self.dimension, self.max_length)

    def _serve(self) -> None:
        embedder = self._load_model()
        if embedder is None:
            return
        pending: dict[str, AddCommand] = {}
        try:
            while True:
                if not self._apply_commands(not pending, partial(self._apply, embedder, pending=pending),
                                            lambda: [add.future for add in pending.values()]):
                    return
                if pending:
                    self._pass(embedder, pending)
                self._waiting = len(pending)
        except BaseException as error:  # noqa: BLE001 - fails its submitters, not silently
            logger.exception("embedder %s crashed", self.name)
            self._die(error, [add.future for add in pending.values()])

    def _apply(self, embedder: Embedder, command: WorkCommand, pending: dict[str, AddCommand]) -> None:
        if isinstance(command, AddCommand):
            if command.future.set_running_or_notify_cancel():
                pending[command.request_id] = command
        elif isinstance(command, AbortCommand):
            for request_id in command.request_ids:
                add = pending.pop(request_id, None)
                self._tokenized.pop(request_id, None)
                if add is not None:
                    add.future.set_result(EmbedResult(None, 0, aborted=True))
        else:
            self._run_call(embedder, command)

    def _pass(self, embedder: Embedder, pending: dict[str, AddCommand]) -> None:
        """Embed about one pass of tokens: the highest-priority waiting sequences first, the longest
        first within a priority (identical ones pooled the same way once)."""
        sequences: dict[_Key, list[str]] = {}
        for request_id, add in list(pending.items()):
            ids = self._tokenized.get(request_id)
            if ids is None:
                ids = self._token_ids(embedder, add)
            if ids is None:  # answered already (a tokenizer error, or too long)
                del pending[request_id]
                continue
            self._tokenized[request_id] = ids
            sequences.setdefault((ids, add.request.pooling, add.request.normalize), []).append(request_id)
        budget = int(getattr(embedder, "batch_tokens", DEFAULT_PASS_TOKENS))

        def rank(key: _Key) -> tuple[int, int]:
            return min(pending[request_id].request.priority for request_id in sequences[key]), -len(key[0])

        chosen: dict[tuple[Pooling | None, bool | None], list[_Key]] = {}  # by the pooling they ask for
        tokens = 0
        for key in sorted(sequences, key=rank):
            if chosen and tokens + len(key[0]) > budget:
                break
            chosen.setdefault(key[1:], []).append(key)
            tokens += len(key[0])
        self._waiting = len(pending)
        for (pooling, normalize), keys in chosen.items():
            started = time.monotonic()
            results = self._embed(embedder, [key[0] for key in keys], pooling, normalize)
            seconds = time.monotonic() - started
            group_tokens = sum(len(key[0]) for key in keys)
            self._busy_s += seconds
            self._tokens_computed += group_tokens
            per_token = seconds / max(group_tokens, 1)
            for key, (vector, error) in zip(keys, results, strict=True):
                for request_id in sequences[key]:
                    add = pending.pop(request_id)
                    self._tokenized.pop(request_id, None)
                    add.future.set_result(EmbedResult(vector, len(key[0]), error,
                                                      seconds=per_token * len(key[0])))

    def _token_ids(self, embedder: Embedder, add: AddCommand) -> tuple[int, ...] | None:
        """The input's sequence, truncated when it asked; None once its future holds an error."""
        value = add.request.value
        try:
            ids = list(value) if isinstance(value, tuple) else embedder.tokenize(value)
        except Exception as error:  # noqa: BLE001 - a tokenizer may raise anything on odd text
            add.future.set_result(EmbedResult(None, 0, "the model's tokenizer failed on this input: "
                                              f"{type(error).__name__}: {str(error)[:200]}"))
            return None
        limit = embedder.config.max_length
        whose = "the model's maximum"
        if add.request.max_length is not None and add.request.max_length < limit:
            limit, whose = add.request.max_length, "the job's max_length"
        if len(ids) > limit:
            if not add.request.truncate:
                message = (f"the input has {len(ids)} tokens, more than {whose} of {limit} "
                           "(truncate: true cuts it)")
                add.future.set_result(EmbedResult(None, len(ids), message, too_long=True))
                return None
            ids = truncated(ids, limit, set(getattr(embedder.tokenizer, "all_special_ids", ())))
        return tuple(ids)

    @staticmethod
    def _embed(embedder: Embedder, chosen: list[tuple[int, ...]], pooling: Pooling | None = None,
               normalize: bool | None = None) -> list[tuple[Vector | None, str | None]]:
        """(vector, None) or (None, why) per sequence, pooled as asked (None: the model's way). A
        pooling the model does not allow fails every sequence with the reason. A sequence the embedder
        refuses (ValueError: an id outside its vocabulary…) fails alone: when a pass raises, each
        sequence runs on its own. Any other failure ends the host (the shard is retried on a fresh
        one, as after an engine crash)."""
        given = (("pooling", pooling), ("normalize", normalize))
        asked: dict[str, Any] = {name: value for name, value in given if value is not None}
        if asked:
            try:
                embedder.pooling_config(**asked)
            except ValueError as error:
                return [(None, str(error)[:300])] * len(chosen)
        try:
            return [(output.embedding, None) for output in embedder.embed_token_ids(chosen, **asked)]
        except Exception as error:  # noqa: BLE001 - find the sequences at fault
            if len(chosen) == 1:
                if isinstance(error, ValueError):
                    return [(None, _refusal(error))]
                raise
        results: list[tuple[Vector | None, str | None]] = []
        for ids in chosen:
            try:
                results.append((embedder.embed_token_ids([ids], **asked)[0].embedding, None))
            except ValueError as error:
                results.append((None, _refusal(error)))
        return results


def truncated(ids: list[int], limit: int, special_ids: set[int]) -> list[int]:
    """The first `limit` tokens, keeping a closing special token (BERT's [SEP], a decoder's EOS) last,
    as the tokenizer's own truncation does."""
    if len(ids) <= limit:
        return ids
    if ids[-1] in special_ids:
        return [*ids[:limit - 1], ids[-1]]
    return ids[:limit]


def _refusal(error: ValueError) -> str:
    """The embedder's reason for one sequence, which it names "input 0" (the only one it was given)."""
    text = str(error)[:300]
    return "the input " + text.removeprefix("input 0 ") if text.startswith("input 0 ") else text
