"""`ModelHost`: one long-lived model in its own thread, fed by any number of threads through a
command queue. The base of `EngineHost` (an `LLMEngine`) and `EmbedHost` (an `Embedder`).

A model is not thread-safe, so only its thread touches it. Other threads send commands (add
requests, abort them, run a function on the model, stop) that the thread drains between steps, and
get answers back through futures. While the model has work its thread never blocks on the queue;
idle, it waits on it, so an idle host costs no CPU. A subclass says what a loaded model tells the
host (`_on_loaded`) and how its thread serves it (`_serve`, which loads it with `_load_model`).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any, Generic, Self, TypeVar

logger = logging.getLogger(__name__)

# How long an idle model thread sleeps on the queue before checking again that it should live.
IDLE_POLL_S = 1.0

Model = TypeVar("Model")
Request = TypeVar("Request")
Output = TypeVar("Output")


class EngineUnavailable(RuntimeError):
    """The model failed to load, crashed in a step, or was stopped; the message says which."""


@dataclass(frozen=True)
class AddCommand(Generic[Request, Output]):
    request_id: str
    request: Request
    future: Future[Output]


@dataclass(frozen=True)
class AbortCommand:
    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class CallCommand(Generic[Model]):
    """Run `function(model)` on the model's thread (metrics, tests); the answer comes via `future`."""

    function: Callable[[Model], Any]
    future: Future[Any]


@dataclass(frozen=True)
class StopCommand:
    pass


# What a host's thread applies to its model; a StopCommand ends the thread before it is applied.
WorkCommand = AddCommand[Any, Any] | AbortCommand | CallCommand[Any]
Command = WorkCommand | StopCommand


class HostSubmission(Generic[Output]):
    """The requests of one `submit` call: their outputs come back in the order they were given."""

    def __init__(self, host: ModelHost[Any, Any, Output], request_ids: list[str],
                 futures: list[Future[Output]]) -> None:
        self._host = host
        self.request_ids = request_ids
        self.futures = futures

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every output is in (True) or `timeout` seconds pass (False)."""
        _, not_done = wait_futures(self.futures, timeout=timeout)
        return not not_done

    def results(self) -> list[Output]:
        """Outputs in submit order; raises `EngineUnavailable` if the model died before finishing."""
        return [future.result(timeout=0) for future in self.futures]

    def abort(self) -> None:
        """Stop every request of this submission that has not finished."""
        self._host.abort(rid for rid, future in zip(self.request_ids, self.futures, strict=True)
                         if not future.done())


class ModelHost(Generic[Model, Request, Output]):
    """Loads the model with `load()` in its own thread, then serves it for as long as it lives.

    Requests may be submitted before the model is ready: they wait in the queue. If loading fails,
    every waiting and later submission fails with `EngineUnavailable` carrying the reason.
    """

    noun = "model"  # what the messages call it
    thread_prefix = "model"  # its thread is "<thread_prefix>-<name>"

    def __init__(self, load: Callable[[], Model], name: str) -> None:
        self.name = name
        self._load = load
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._ids = itertools.count()
        self._ids_lock = threading.Lock()
        self._ready = threading.Event()
        self._dead = threading.Event()
        self._settled = threading.Event()  # set once the model is ready or dead, whichever first
        self._failure: BaseException | None = None
        self._start_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.crashes = 0  # steps that raised (each rebuilt the model), where the host rebuilds
        self.load_seconds: float | None = None  # how long the model took to load, once it is loaded
        self.device: str | None = None  # where it computes ("cpu", "cuda"), once it is loaded

    # ---- lifecycle -----------------------------------------------------------------------------

    def start(self) -> Self:
        """Start the model's thread (once; later calls do nothing)."""
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name=f"{self.thread_prefix}-{self.name}",
                                                daemon=True)
                self._thread.start()
        return self

    def wait_ready(self, timeout: float | None = None) -> bool:
        """True once the model is loaded, False on timeout; raises `EngineUnavailable` if it failed
        to load or has died since.
        """
        self._settled.wait(timeout)
        if self._dead.is_set():
            raise self._unavailable()
        return self._ready.is_set()

    @property
    def loaded(self) -> bool:
        """True once the model has loaded (it may have died since)."""
        return self._ready.is_set()

    @property
    def failure(self) -> BaseException | None:
        """Why the model's thread ended (load error, step error), or None while it is healthy."""
        return self._failure

    def stop(self, timeout: float | None = 30) -> None:
        """Stop serving; unfinished submissions fail with `EngineUnavailable`."""
        self._commands.put(StopCommand())
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- requests ------------------------------------------------------------------------------

    def _queue(self, requests: Sequence[Request]) -> tuple[list[str], list[Future[Output]]]:
        """Queue `requests` for the model, in this order; their ids and futures, at once."""
        if self._dead.is_set():
            raise self._unavailable()
        with self._ids_lock:
            ids = [f"{self.name}-{next(self._ids)}" for _ in requests]
        futures: list[Future[Output]] = [Future() for _ in requests]
        for request_id, request, future in zip(ids, requests, futures, strict=True):
            self._commands.put(AddCommand(request_id, request, future))
        if self._dead.is_set():  # died while we queued: nobody will answer these
            self._fail_futures(futures)
        return ids, futures

    def abort(self, request_ids: Iterable[str]) -> None:
        """Abort these requests if they have not finished; unknown ids are ignored."""
        ids = tuple(request_ids)
        if ids:
            self._commands.put(AbortCommand(ids))

    def call(self, function: Callable[[Model], Any], timeout: float | None = 30) -> Any:
        """Run `function(model)` between two steps and return its result (e.g. `get_metrics`)."""
        future: Future[Any] = Future()
        self._commands.put(CallCommand(function, future))
        if self._dead.is_set():
            self._fail_futures([future])
        return future.result(timeout)

    # ---- the model's thread --------------------------------------------------------------------

    def _load_model(self) -> Model | None:
        """The model, loaded on its thread (None: it failed, and the host is dead with the reason).
        `_serve` holds the only reference: a crashed model dropped there is freed (EngineHost)."""
        started = time.monotonic()
        try:
            model = self._load()
        except BaseException as error:  # noqa: BLE001 - reported to every submitter
            logger.exception("%s %s failed to load", self.noun, self.name)
            self._die(error)
            return None
        self.load_seconds = time.monotonic() - started
        self._on_loaded(model)
        self._ready.set()
        self._settled.set()
        return model

    def _on_loaded(self, model: Model) -> None:
        """Read what the host reports from the loaded model (its dtype, device, sizes), and log it."""

    def _serve(self) -> None:
        """The model's thread: `_load_model()`, then drain commands and run the model until stopped
        (`_die`)."""
        raise NotImplementedError

    def _drain(self, block: bool) -> list[Command]:
        commands: list[Command] = []
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

    def _apply_commands(self, block: bool, apply: Callable[[WorkCommand], None],
                        pending: Callable[[], Iterable[Future[Any]]]) -> bool:
        """`apply` each waiting command in order (waiting up to `IDLE_POLL_S` for one when `block`);
        False once a stop came: the host is then dead and `pending()`'s futures failed."""
        for command in self._drain(block):
            if isinstance(command, StopCommand):
                self._die(EngineUnavailable(f"{self.noun} {self.name} was stopped"), pending())
                return False
            apply(command)
        return True

    @staticmethod
    def _run_call(model: Model, command: CallCommand[Any]) -> None:
        try:
            command.future.set_result(command.function(model))
        except Exception as error:  # noqa: BLE001 - the caller gets it back
            command.future.set_exception(error)

    def _die(self, error: BaseException, pending: Iterable[Future[Any]] = ()) -> None:
        self._failure = error
        self._dead.set()
        self._settled.set()
        self._fail_futures(list(pending))
        # Commands that arrived after the last drain: nobody will ever answer them.
        for command in self._drain(block=False):
            if isinstance(command, AddCommand | CallCommand):
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
        return EngineUnavailable(f"{self.noun} {self.name} is unavailable: {self._failure!r}")
