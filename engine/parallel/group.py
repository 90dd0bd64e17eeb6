"""Rank 0's side of a tensor-parallel engine: it starts ranks 1..N-1, sends each of them every
forward it runs, and fails cleanly when one dies.

Ranks run as ``python -m bulkinfer.engine.parallel.rank_main`` processes (no CUDA state forked, and the
user's main module is not re-run), each over a socket pair with rank 0. The engine process is
rank 0: it owns the scheduler, KV block manager, sampler and detokenizer, and runs its own share
of every forward. The other ranks hold no scheduling state at all: each forward's inputs reach
them as the step's rows (token ids, positions, block ids), and they rebuild the same batch from
them. A rank that dies closes its connections: the collective rank 0 is in fails at once (or
after COLLECTIVE_TIMEOUT_S for a rank that hangs), a watchdog thread aborts the group when a rank
process exits, and the step raises `TensorParallelError` naming the rank and why, after stopping
the others.
"""

from __future__ import annotations

import logging
import multiprocessing
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing.connection import Connection

import torch

from bulkinfer.engine.config import EngineConfig
from bulkinfer.engine.parallel.communicator import Communicator, free_port
from bulkinfer.engine.parallel.rank_spec import RankSpec, rank_device

logger = logging.getLogger(__name__)

# Rank processes get this long to start, join the group and load their part of the model.
START_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 5.0
WATCH_INTERVAL_S = 0.2


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank died or failed: the engine cannot step any more (rebuild it)."""


class TensorParallelGroup:
    """Ranks 1..N-1 and the communicator rank 0 shares with them."""

    def __init__(self, config: EngineConfig, start_timeout_s: float = START_TIMEOUT_S) -> None:
        self.world = config.tensor_parallel_size
        self.device = rank_device(config.device, 0)
        self._saved_threads = torch.get_num_threads()
        # The ranks share the host's cores (on CPU they compute at the same time).
        threads = max(1, self._saved_threads // self.world)
        port = free_port()
        self._processes: list[subprocess.Popen] = []
        self._conns: list[Connection] = []
        self._failure: TensorParallelError | None = None
        self._stopped = threading.Event()
        for rank in range(1, self.world):
            parent_end, child_end = multiprocessing.Pipe()
            fd = child_end.fileno()
            process = subprocess.Popen([sys.executable, "-m", "bulkinfer.engine.parallel.rank_main", str(fd)],
                                       pass_fds=[fd])
            child_end.close()
            parent_end.send(RankSpec(rank, self.world, port, config, threads, start_timeout_s))
            self._processes.append(process)
            self._conns.append(parent_end)
        # Stop the ranks with the engine, however it goes (garbage collected, interpreter exit).
        self._finalizer = weakref.finalize(self, _stop_processes, self._processes, self._conns, self._stopped)
        try:
            # Every rank alive and about to join before this one blocks in the rendezvous.
            self._wait_for("joining", "starting", start_timeout_s)
            self.communicator = Communicator.connect(0, self.world, port, self.device, start_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        if self.device.type == "cpu":
            torch.set_num_threads(threads)
        # A function of its own, not a method: the thread must not keep the group alive.
        self._watchdog = threading.Thread(target=_watch, name="tensor-parallel-watchdog", daemon=True,
                                          args=(self._processes, self._stopped, self.communicator))
        self._watchdog.start()

    @property
    def rank_pids(self) -> list[int]:
        return [p.pid for p in self._processes if p.pid is not None]

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Wait until every rank has loaded its part of the model; raise TensorParallelError with the
        rank's own error where one failed."""
        self._wait_for("ready", "loading", timeout_s)

    def _wait_for(self, expected: str, doing: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for rank, conn in enumerate(self._conns, start=1):
            process = self._processes[rank - 1]
            while not conn.poll(0.1):
                if process.poll() is not None:
                    raise self.fail(f"rank {rank} exited (code {process.returncode}) while {doing}")
                if time.monotonic() > deadline:
                    raise self.fail(f"rank {rank} did not finish {doing} in {timeout_s:.0f} s")
            kind, detail = self._receive(conn)
            if kind != expected:
                logger.error("tensor parallel rank %d failed while %s:\n%s", rank, doing, detail)
                raise self.fail(f"rank {rank} failed while {doing}: {_last_line(detail)}")

    def send(self, *message: object) -> None:
        """Have every other rank run `message` (see rank_worker.follow) alongside rank 0."""
        if self._failure is not None:
            raise self._failure
        for rank, conn in enumerate(self._conns, start=1):
            try:
                conn.send(message)
            except OSError:
                raise self.fail(f"rank {rank} is gone") from None

    def fail(self, what: str) -> TensorParallelError:
        """Stop every rank and return the error for this group (rank reports and exit codes
        included); the group refuses every later send with it."""
        if self._failure is not None:
            return self._failure
        reports = self._rank_reports()
        story = f"{'; '.join(reports)} ({what})" if reports else what
        self._failure = TensorParallelError(f"tensor parallel engine failed: {story}")
        logger.error("%s", self._failure)
        self.shutdown()
        return self._failure

    def shutdown(self) -> None:
        """Stop the other ranks (idempotent) and give this process its threads back."""
        self._finalizer()
        if self.device.type == "cpu":
            torch.set_num_threads(self._saved_threads)

    # ---- internals -----------------------------------------------------------------------------

    def _rank_reports(self) -> list[str]:
        """What the ranks said (an exception) or how they exited, waiting briefly for the dying."""
        reports = []
        deadline = time.monotonic() + 1.0
        for rank, (process, conn) in enumerate(zip(self._processes, self._conns, strict=True), start=1):
            detail = None
            while time.monotonic() < deadline:
                if conn.poll(0.05):
                    kind, said = self._receive(conn)
                    if kind == "error":
                        detail = said
                        break
                    if kind == "gone":
                        break
                elif process.poll() is not None:
                    break
            if detail is None:
                try:
                    process.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            if detail is not None:
                reports.append(f"rank {rank} raised: {_last_line(detail)}")
                logger.error("tensor parallel rank %d raised:\n%s", rank, detail)
            elif process.poll() is not None:
                reports.append(f"rank {rank} exited with code {process.returncode}")
        return reports

    @staticmethod
    def _receive(conn: Connection) -> tuple[str, str | None]:
        try:
            return conn.recv()
        except (EOFError, OSError):
            return "gone", "its connection closed"


def _watch(processes: list[subprocess.Popen], stopped: threading.Event, communicator: Communicator) -> None:
    """Abort the group's collectives when a rank process exits, so rank 0 never waits on it."""
    while not stopped.wait(WATCH_INTERVAL_S):
        if any(process.poll() is not None for process in processes):
            if not stopped.is_set():
                logger.error("a tensor parallel rank exited; aborting the group's collectives")
                communicator.abort()
            return


def _stop_processes(processes: list[subprocess.Popen], conns: list[Connection],
                    stopped: threading.Event) -> None:
    stopped.set()
    for conn in conns:
        try:
            conn.send(("stop",))
        except OSError:
            pass
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(STOP_TIMEOUT_S)
    for conn in conns:
        conn.close()


def _last_line(detail: str | None) -> str:
    """A traceback's last line (the exception); the whole text goes to the log."""
    lines = (detail or "").strip().splitlines()
    return lines[-1] if lines else "no detail"
