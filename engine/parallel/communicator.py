"""The collectives a tensor-parallel model needs (sum across ranks, gather the vocabulary's slices
to rank 0) over one process group of its own: gloo on CPU, NCCL on CUDA.

The group is built directly on a TCP store, not as torch.distributed's global default group, so an
engine can be rebuilt (or several live in one process, as in tests) without global state. Every
collective has a timeout, and a peer that exits closes its connections, so a dead rank surfaces
as a `CollectiveError` on the others instead of a hang.
"""

from __future__ import annotations

import datetime
import socket
import time
from typing import Any

import torch
import torch.distributed as dist

# A collective that waits longer than this has a rank that hangs (a dead one is seen at once).
COLLECTIVE_TIMEOUT_S = 120.0
LOCALHOST = "127.0.0.1"


class CollectiveError(RuntimeError):
    """A collective failed: a peer rank died, hung past the timeout, or the group was aborted."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOCALHOST, 0))
        return int(sock.getsockname()[1])


class Communicator:
    def __init__(self, group: dist.ProcessGroup, rank: int, world: int, device: torch.device) -> None:
        self.group, self.rank, self.world, self.device = group, rank, world, device
        self._store: object | None = None  # the TCP store the group was made with: kept alive
        # Seconds this rank has spent in collectives (moving data, and waiting for slower ranks):
        # what tensor parallelism costs it, read by benchmarks.
        self.seconds_in_collectives = 0.0

    @staticmethod
    def connect(rank: int, world: int, port: int, device: torch.device, timeout_s: float,
                collective_timeout_s: float = COLLECTIVE_TIMEOUT_S) -> Communicator:
        """Join the group of `world` ranks whose store rank 0 serves on `port` (waits up to
        `timeout_s` for every rank to arrive)."""
        store = dist.TCPStore(LOCALHOST, port, world, rank == 0,
                              timeout=datetime.timedelta(seconds=timeout_s))
        timeout = datetime.timedelta(seconds=collective_timeout_s)
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            group: Any = dist.ProcessGroupNCCL(store, rank, world, options)
        else:
            options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # torch's own way to set a timeout
            options._timeout = timeout
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=LOCALHOST)]
            group = dist.ProcessGroupGloo(store, rank, world, options)
        communicator = Communicator(group, rank, world, device)
        communicator._store = store  # the group needs its store alive
        return communicator

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place; every rank gets the same bits."""
        self._wait(self.group.allreduce([tensor]))
        return tensor

    def gather_columns(self, local: torch.Tensor, size: int) -> torch.Tensor:
        """Rank 0: every rank's `local` [rows, share] side by side, cut to `size` columns (the
        vocabulary without its padding). Other ranks: `local` (they do not sample)."""
        local = local.contiguous()
        options = dist.GatherOptions()
        options.rootRank = 0
        if self.rank != 0:
            self._wait(self.group.gather([], [local], options))
            return local
        parts = [torch.empty_like(local) for _ in range(self.world)]
        self._wait(self.group.gather([parts], [local], options))
        return torch.cat(parts, dim=-1)[..., :size]

    def abort(self) -> None:
        """Fail any collective in flight (a watchdog saw a rank die)."""
        abort = getattr(self.group, "abort", None)
        if abort is not None:
            abort()

    def _wait(self, work: dist.Work) -> None:
        started = time.perf_counter()
        try:
            work.wait()
        except RuntimeError as error:
            raise CollectiveError(str(error)) from None
        finally:
            self.seconds_in_collectives += time.perf_counter() - started
