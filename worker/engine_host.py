"""`EngineHost`: one long-lived `LLMEngine` stepping in its own thread, fed by any number of threads.

`LLMEngine` is not thread-safe, so only the engine thread touches it. Other threads talk to it
through a command queue the engine thread drains between steps (add requests, abort them, read
metrics, stop) and get answers back through futures. While the engine has work it never blocks on
the queue; when idle it waits on it, so an idle host costs no CPU.

The engine thread does no object-store I/O: callers hand it prompts and take outputs away.
"""

from __future__ import annotations

import gc
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any

import torch

from engine import ErrorKind, LLMEngine, RequestOutput, SamplingParams
from engine.dtype_choice import DtypeChoice
from engine.outputs import CompletionOutput
from worker.crash_isolation import CrashIsolation

logger = logging.getLogger(__name__)

# How long an idle engine thread sleeps on the queue before checking again that it should live.
IDLE_POLL_S = 1.0


class EngineUnavailable(RuntimeError):
    """The engine failed to load, crashed in a step, or was stopped; the message says which."""


@dataclass(frozen=True)
class EngineRequest:
    """One prompt for the engine: text, or token ids already rendered by the caller."""

    prompt: str | Sequence[int]
    params: SamplingParams
    priority: int = 0  # lower runs sooner (the engine's convention), with scheduling_policy="priority"
    cache_salt: str | None = None  # prefix-cache blocks are shared only between equal salts


@dataclass(frozen=True)
class _Add:
    request_id: str
    request: EngineRequest
    future: Future[RequestOutput]


@dataclass(frozen=True)
class _Abort:
    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class _Call:
    """Run `function(engine)` on the engine thread (metrics, tests); the answer comes via `future`."""

    function: Callable[[LLMEngine], Any]
    future: Future[Any]


@dataclass(frozen=True)
class _Stop:
    pass


class Submission:
    """The requests of one `submit` call: their outputs come back in the order they were given."""

    def __init__(self, host: EngineHost, request_ids: list[str],
                 futures: list[Future[RequestOutput]]) -> None:
        self._host = host
        self.request_ids = request_ids
        self.futures = futures

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every output is in (True) or `timeout` seconds pass (False)."""
        _, not_done = wait_futures(self.futures, timeout=timeout)
        return not not_done

    def results(self) -> list[RequestOutput]:
        """Outputs in submit order; raises `EngineUnavailable` if the engine died before finishing."""
        return [future.result(timeout=0) for future in self.futures]

    def abort(self) -> None:
        """Stop every request of this submission that has not finished (their outputs say `abort`)."""
        self._host.abort(rid for rid, future in zip(self.request_ids, self.futures, strict=True)
                         if not future.done())


class EngineHost:
    """Builds the engine with `load_engine()` in its own thread, then steps it for as long as it lives.

    Requests may be submitted before the engine is ready: they wait in the queue. If loading fails,
    every waiting and later submission fails with `EngineUnavailable` carrying the reason.
    """

    def __init__(self, load_engine: Callable[[], LLMEngine], name: str = "engine") -> None:
        self.name = name
        self._load_engine = load_engine
        self._commands: queue.SimpleQueue[_Add | _Abort | _Call | _Stop] = queue.SimpleQueue()
        self._ids = itertools.count()
        self._ids_lock = threading.Lock()
        self._ready = threading.Event()
        self._dead = threading.Event()
        self._settled = threading.Event()  # set once the engine is ready or dead, whichever first
        self._failure: BaseException | None = None
        self._start_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.dtype_choice: DtypeChoice | None = None  # the engine's dtype and why, once it is loaded
        self.crashes = 0  # engine steps that raised (each rebuilt the engine)
        self.load_seconds: float | None = None  # how long the engine took to build, once it is loaded
        self.device: str | None = None  # where it computes ("cpu", "cuda"), once it is loaded

    # ---- lifecycle -----------------------------------------------------------------------------

    def start(self) -> EngineHost:
        """Start the engine thread (once; later calls do nothing)."""
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"engine-{self.name}", daemon=True)
                self._thread.start()
        return self

    def wait_ready(self, timeout: float | None = None) -> bool:
        """True once the engine is loaded, False on timeout; raises `EngineUnavailable` if it failed
        to load or has died since.
        """
        self._settled.wait(timeout)
        if self._dead.is_set():
            raise self._unavailable()
        return self._ready.is_set()

    @property
    def loaded(self) -> bool:
        """True once the engine has loaded (it may have died since)."""
        return self._ready.is_set()

    @property
    def failure(self) -> BaseException | None:
        """Why the engine thread ended (load error, step error), or None while it is healthy."""
        return self._failure

    def stop(self, timeout: float | None = 30) -> None:
        """Stop stepping; unfinished submissions fail with `EngineUnavailable`."""
        self._commands.put(_Stop())
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- requests ------------------------------------------------------------------------------

    def submit(self, requests: Sequence[EngineRequest]) -> Submission:
        """Queue `requests` for the engine, in this order; returns their futures at once."""
        if self._dead.is_set():
            raise self._unavailable()
        with self._ids_lock:
            ids = [f"{self.name}-{next(self._ids)}" for _ in requests]
        futures: list[Future[RequestOutput]] = [Future() for _ in requests]
        for request_id, request, future in zip(ids, requests, futures, strict=True):
            self._commands.put(_Add(request_id, request, future))
        if self._dead.is_set():  # died while we queued: nobody will answer these
            self._fail_futures(futures)
        return Submission(self, ids, futures)

    def abort(self, request_ids: Iterable[str]) -> None:
        """Abort these requests if they have not finished; unknown ids are ignored."""
        ids = tuple(request_ids)
        if ids:
            self._commands.put(_Abort(ids))

    def call(self, function: Callable[[LLMEngine], Any], timeout: float | None = 30) -> Any:
        """Run `function(engine)` between two steps and return its result (e.g. `get_metrics`)."""
        future: Future[Any] = Future()
        self._commands.put(_Call(function, future))
        if self._dead.is_set():
            self._fail_futures([future])
        return future.result(timeout)

    # ---- the engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        started = time.monotonic()
        try:
            engine = self._load_engine()
        except BaseException as error:  # noqa: BLE001 - reported to every submitter
            logger.exception("engine %s failed to load", self.name)
            self._die(error)
            return
        self.load_seconds = time.monotonic() - started
        self.device = str(engine.config.device)
        self.dtype_choice = engine.dtype_choice
        self._ready.set()
        self._settled.set()
        logger.info("engine %s ready (dtype %s: %s)", self.name, engine.dtype_choice.dtype,
                    engine.dtype_choice.reason)
        requests = _Requests()
        try:
            while True:
                busy = engine.has_unfinished_requests()
                for command in self._drain(block=not busy):
                    if isinstance(command, _Stop):
                        self._die(EngineUnavailable(f"engine {self.name} was stopped"), requests.futures())
                        return
                    self._apply(engine, command, requests)
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
        the suspects a group at a time (worker/crash_isolation.py). The caller holds no reference
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
        engine = self._load_engine()
        requests.advance(engine)
        return engine

    def _drain(self, block: bool) -> list[_Add | _Abort | _Call | _Stop]:
        commands = []
        if block:
            try:
                commands.append(self._commands.get(timeout=IDLE_POLL_S))
            except queue.Empty:
                return []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    @staticmethod
    def _apply(engine: LLMEngine, command: _Add | _Abort | _Call, requests: _Requests) -> None:
        if isinstance(command, _Add):
            if not command.future.set_running_or_notify_cancel():
                return  # the submitter gave up on it before it reached the engine
            requests.accept(engine, command)
        elif isinstance(command, _Abort):
            for request_id in command.request_ids:
                if not requests.abort_outside_engine(request_id):
                    engine.abort_request(request_id)
        else:
            try:
                command.future.set_result(command.function(engine))
            except Exception as error:  # noqa: BLE001 - the caller gets it back
                command.future.set_exception(error)

    def _die(self, error: BaseException, pending: Iterable[Future[RequestOutput]] = ()) -> None:
        self._failure = error
        self._dead.set()
        self._settled.set()
        self._fail_futures(list(pending))
        # Commands that arrived after the last drain: nobody will ever answer them.
        for command in self._drain(block=False):
            if isinstance(command, _Add | _Call):
                self._fail_futures([command.future])

    def _fail_futures(self, futures: Iterable[Future[Any]]) -> None:
        for future in futures:
            if future.done():
                continue
            try:
                future.set_exception(self._unavailable())
            except Exception:  # noqa: BLE001, S110 - it finished or was cancelled meanwhile
                pass

    def _unavailable(self) -> EngineUnavailable:
        if isinstance(self._failure, EngineUnavailable):
            return self._failure
        return EngineUnavailable(f"engine {self.name} is unavailable: {self._failure!r}")


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
        self.accepted: dict[str, _Add] = {}  # not finished yet, in the engine or not
        self.in_engine: set[str] = set()
        self.isolation = CrashIsolation()

    def futures(self) -> list[Future[RequestOutput]]:
        return [add.future for add in self.accepted.values()]

    def accept(self, engine: LLMEngine, add: _Add) -> None:
        self.accepted[add.request_id] = add
        if not self.isolation.active:
            self._add(engine, add.request_id)

    def _add(self, engine: LLMEngine, request_id: str) -> None:
        add = self.accepted[request_id]
        try:
            engine.add_request(request_id, add.request.prompt, add.request.params,
                               priority=add.request.priority, cache_salt=add.request.cache_salt)
        except Exception as error:  # noqa: BLE001 - a caller bug for this request only
            del self.accepted[request_id]
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


def _unrun_output(request_id: str, request: EngineRequest, reason: str, error: str | None) -> RequestOutput:
    """The output of a request that ended outside the engine: failed (`error`) or aborted."""
    prompt_ids = [] if isinstance(request.prompt, str) else list(request.prompt)
    samples = [CompletionOutput(index, "", [], reason) for index in range(request.params.n)]
    text = request.prompt if isinstance(request.prompt, str) else None
    kind = ErrorKind.ENGINE_FAILURE if error is not None else None  # it crashed the engine, or it died
    return RequestOutput(request_id=request_id, prompt=text, prompt_token_ids=prompt_ids, text="",
                         token_ids=[], finish_reason=reason, error=error, num_prompt_tokens=len(prompt_ids),
                         num_cached_tokens=0, num_completion_tokens=0, metrics=None, outputs=samples,
                         error_kind=kind)
