"""`EngineHost`: one long-lived `LLMEngine` stepping in its own thread, fed by any number of threads.

`LLMEngine` is not thread-safe, so only the engine thread touches it. Other threads talk to it
through a command queue the engine thread drains between steps (add requests, abort them, read
metrics, stop) and get answers back through futures (worker/hosts/model_host.py, shared with the
`EmbedHost`). While the engine has work it never blocks on the queue; when idle it waits on it, so
an idle host costs no CPU. A step that raises rebuilds the engine and finds the request at fault.

The engine thread does no object-store I/O: callers hand it prompts and take outputs away.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial

import torch

from bulkinfer.engine import ErrorKind, LLMEngine, LoRARequest, RequestOutput, SamplingParams
from bulkinfer.engine.dtype_choice import DtypeChoice
from bulkinfer.engine.multimodal.inputs import MultiModalPrompt
from bulkinfer.engine.outputs import CompletionOutput
from bulkinfer.worker.hosts.crash_isolation import CrashIsolation
from bulkinfer.worker.hosts.model_host import (
    AbortCommand,
    AddCommand,
    EngineUnavailable,
    HostSubmission,
    ModelHost,
    WorkCommand,
)

logger = logging.getLogger(__name__)

__all__ = ["EngineHost", "EngineRequest", "EngineUnavailable", "Submission", "release_engine_memory"]


@dataclass(frozen=True)
class EngineRequest:
    """One prompt for the engine: text, or token ids already rendered by the caller."""

    prompt: str | Sequence[int] | MultiModalPrompt  # with images: expanded by the model's processor
    params: SamplingParams
    priority: int = 0  # lower runs sooner (the engine's convention), with scheduling_policy="priority"
    cache_salt: str | None = None  # prefix-cache blocks are shared only between equal salts
    lora_request: LoRARequest | None = None  # the LoRA adapter it runs on; None: the base model


# `error_kind` of a request whose LoRA adapter the engine refused (rank, shapes, LoRA off): the
# engine raises for it at add_request, and it becomes the row's `invalid_lora` error, not a crash.
LORA_REFUSED = "lora_refused"


class Submission(HostSubmission[RequestOutput]):
    """The requests of one `submit` call: their outputs come back in the order they were given; an
    aborted request's output says `abort`."""


class EngineHost(ModelHost[LLMEngine, EngineRequest, RequestOutput]):
    """Builds the engine with `load_engine()` in its own thread, then steps it for as long as it lives.

    Requests may be submitted before the engine is ready: they wait in the queue. If loading fails,
    every waiting and later submission fails with `EngineUnavailable` carrying the reason.
    """

    noun = "engine"
    thread_prefix = "engine"

    def __init__(self, load_engine: Callable[[], LLMEngine], name: str = "engine") -> None:
        super().__init__(load_engine, name)
        self.dtype_choice: DtypeChoice | None = None  # the engine's dtype and why, once it is loaded
        self.quantization: str | None = None  # its checkpoint's quantization scheme, once loaded

    def submit(self, requests: Sequence[EngineRequest]) -> Submission:
        """Queue `requests` for the engine, in this order; returns their futures at once."""
        return Submission(self, *self._queue(requests))

    # ---- the engine thread ---------------------------------------------------------------------

    def _on_loaded(self, engine: LLMEngine) -> None:
        self.device = str(engine.config.device)
        self.dtype_choice = engine.dtype_choice
        self.quantization = engine.quantization
        logger.info("engine %s ready (dtype %s: %s)", self.name, engine.dtype_choice.dtype,
                    engine.dtype_choice.reason)

    def _serve(self) -> None:
        engine = self._load_model()
        if engine is None:
            return
        requests = _Requests()
        try:
            while True:
                busy = engine.has_unfinished_requests()
                if not self._apply_commands(not busy, partial(self._apply, engine, requests=requests),
                                            requests.futures):
                    return
                if not engine.has_unfinished_requests():
                    continue
                try:
                    outputs = engine.step()
                except Exception as error:  # noqa: BLE001 - find the request at fault, rerun the rest
                    crash: Exception | None = _without_frames(error)
                else:
                    crash = None
                if crash is not None:
                    del engine  # the last reference: the rebuilt engine needs the old one's memory
                    engine = self._recover(crash, requests)
                    continue
                for output in outputs:
                    requests.finish(output)
                if len(requests.accepted) > len(requests.in_engine):  # a crash search goes on
                    requests.advance(engine)
        except BaseException as error:  # noqa: BLE001 - a crashed step fails its submitters, not silently
            logger.exception("engine %s crashed", self.name)
            self._die(error, requests.futures())

    def _recover(self, error: Exception, requests: _Requests) -> LLMEngine:
        """A step raised: fail the request found at fault (if any), rebuild the engine, and rerun
        the suspects a group at a time (worker/hosts/crash_isolation.py). The caller holds no reference
        to the crashed engine any more (nor does `error`), so its weights and KV cache are freed
        before the new one is built and sized: on a GPU both would not fit."""
        self.crashes += 1
        culprits = requests.isolation.crashed(requests.in_engine)
        logger.error("engine %s: a step with %d request(s) raised %r; %s", self.name, len(requests.in_engine),
                     error, f"failing {culprits[0]}, which crashed it alone" if culprits
                     else "rebuilding the engine and rerunning them in groups")
        for request_id in culprits:
            requests.fail(request_id, f"the engine crashed twice while running this request: {error!r}")
        requests.in_engine.clear()
        release_engine_memory()
        engine = self._load()
        requests.advance(engine)
        return engine

    def _apply(self, engine: LLMEngine, command: WorkCommand, requests: _Requests) -> None:
        if isinstance(command, AddCommand):
            if not command.future.set_running_or_notify_cancel():
                return  # the submitter gave up on it before it reached the engine
            requests.accept(engine, command)
        elif isinstance(command, AbortCommand):
            for request_id in command.request_ids:
                if not requests.abort_outside_engine(request_id):
                    engine.abort_request(request_id)
        else:
            self._run_call(engine, command)


def release_engine_memory() -> None:
    """Free what an engine nobody references held: its reference cycles, then (on CUDA) the blocks
    PyTorch's allocator keeps cached, so the next engine's memory profile sees them free."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _without_frames(error: Exception) -> Exception:
    """`error` with its tracebacks dropped (and those of the errors it chains): their frames hold
    the crashed engine (`self` of its step) and would keep it alive through the rebuild."""
    pending: list[BaseException] = [error]
    seen: set[int] = set()
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        current.__traceback__ = None
        pending += [chained for chained in (current.__cause__, current.__context__) if chained is not None]
    return error


class _Requests:
    """The engine thread's view of the requests it accepted: which are in the engine now, which
    wait out a crash search (suspects, and requests that arrived during it)."""

    def __init__(self) -> None:
        self.accepted: dict[str, AddCommand] = {}  # not finished yet, in the engine or not
        self.in_engine: set[str] = set()
        self.isolation = CrashIsolation()

    def futures(self) -> list[Future[RequestOutput]]:
        return [add.future for add in self.accepted.values()]

    def accept(self, engine: LLMEngine, add: AddCommand) -> None:
        self.accepted[add.request_id] = add
        if not self.isolation.active:
            self._add(engine, add.request_id)

    def _add(self, engine: LLMEngine, request_id: str) -> None:
        add = self.accepted[request_id]
        lora = {"lora_request": add.request.lora_request} if add.request.lora_request is not None else {}
        try:
            engine.add_request(request_id, add.request.prompt, add.request.params,
                               priority=add.request.priority, cache_salt=add.request.cache_salt, **lora)
        except Exception as error:  # noqa: BLE001 - a caller bug for this request only
            del self.accepted[request_id]
            if lora and isinstance(error, ValueError):  # LoRAAdapterError, or LoRA off: the row's error
                add.future.set_result(_unrun_output(request_id, add.request, "error", str(error),
                                                    LORA_REFUSED))
            else:
                add.future.set_exception(error)
        else:
            self.in_engine.add(request_id)

    def finish(self, output: RequestOutput) -> None:
        add = self.accepted.pop(output.request_id, None)
        self.in_engine.discard(output.request_id)
        self.isolation.finished(output.request_id)
        if add is not None:
            add.future.set_result(output)

    def fail(self, request_id: str, message: str) -> None:
        add = self.accepted.pop(request_id)
        self.in_engine.discard(request_id)
        add.future.set_result(_unrun_output(request_id, add.request, "error", message))

    def abort_outside_engine(self, request_id: str) -> bool:
        """Abort a request waiting out a crash search (True); False if it is in the engine (or gone)."""
        if request_id in self.in_engine or request_id not in self.accepted:
            return False
        self.isolation.forget(request_id)
        add = self.accepted.pop(request_id)
        add.future.set_result(_unrun_output(request_id, add.request, "abort", None))
        return True

    def advance(self, engine: LLMEngine) -> None:
        """Once the group on trial is done: put the next one in the engine, or, the search over,
        every request that waited."""
        if self.in_engine:
            return
        group = self.isolation.next_trial()
        if group is None and self.isolation.active:
            return
        for request_id in group if group is not None else list(self.accepted):
            self._add(engine, request_id)


def _unrun_output(request_id: str, request: EngineRequest, reason: str, error: str | None,
                  kind: ErrorKind | str | None = None) -> RequestOutput:
    """The output of a request that ended outside the engine: failed (`error`, of `kind`) or aborted."""
    prompt = request.prompt
    prompt_ids = [] if isinstance(prompt, str) else \
        prompt.token_ids if isinstance(prompt, MultiModalPrompt) else list(prompt)
    samples = [CompletionOutput(index, "", [], reason) for index in range(request.params.n)]
    text = request.prompt if isinstance(request.prompt, str) else None
    if kind is None and error is not None:  # it crashed the engine, or it died
        kind = ErrorKind.ENGINE_FAILURE
    return RequestOutput(request_id=request_id, prompt=text, prompt_token_ids=prompt_ids, text="",
                         token_ids=[], finish_reason=reason, error=error, num_prompt_tokens=len(prompt_ids),
                         num_cached_tokens=0, num_completion_tokens=0, metrics=None, outputs=samples,
                         error_kind=kind)
