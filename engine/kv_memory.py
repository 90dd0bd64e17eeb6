"""Memory for paged KV caches.

On CPU the cache comes from an anonymous memory map: the OS hands out zero pages as they are first
touched, so engine start does not write the whole cache (zeroing 4 GiB took 0.5-5 s of a start on
these VMs, the larger figures when the host was under memory pressure) and the process holds only
the blocks a job has used. Zeros still matter: attention paths multiply masked slots by a
probability of 0, and 0 x NaN garbage would be NaN.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import mmap
import os
import threading
import time
from collections.abc import Iterator

import torch

from bulkinfer.engine.models.llama_config import LlamaFamilyConfig

logger = logging.getLogger(__name__)

# Linux >= 5.14: fault a range in writable without touching it from user space. Python 3.11's mmap
# module lacks the constant.
MADV_POPULATE_WRITE = 23
PAGE = mmap.PAGESIZE
# Blocks populated per call, sized so one layer's K (or V) run is about one 2 MiB huge page.
CHUNK_BYTES_PER_LAYER = 2 << 20


def allocate_kv_caches(config: LlamaFamilyConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device) -> list[torch.Tensor]:
    """One zeroed ``[2, num_blocks, kv_heads, block_size, head_dim]`` cache per layer (K and V): the
    engine's one layout (engine/kv_layout.py)."""
    shape = (2, num_blocks, config.num_kv_heads, block_size, config.head_dim)
    return [zeroed_kv_cache(shape, dtype, device) for _ in range(config.num_layers)]


def zeroed_kv_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled tensor of `shape`; on CPU its pages are mapped on first touch."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    # Private, not Python's default shared map: shared anonymous memory is shmem, which transparent
    # huge pages skip (shmem_enabled is "never" by default), so every first write faulted in one
    # 4 KiB page: 0.3 s/GiB on these VMs against 0.08 s/GiB in 2 MiB pages.
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        # 2 MiB pages where the kernel grants them (transparent huge pages in "madvise" mode, the
        # usual default): a first write maps 512x the memory per fault and K/V reads miss the TLB
        # less. A VM still pays its host's first backing of fresh memory (1.7 s/GiB here).
        buffer.madvise(mmap.MADV_HUGEPAGE)
    # The tensor keeps the map alive; it is unmapped when the last view of the cache goes.
    return torch.frombuffer(buffer, dtype=dtype).view(shape)


def populate_kv_caches(caches: list[torch.Tensor], seconds: float, threads: int | None = None) -> int:
    """Map the CPU caches' memory now, in the order blocks are handed out, for at most `seconds`.

    A first write to a page costs a fault; on the VMs we measure on, whose host backs guest memory
    in 4 KiB pages on first use, 1.7-3 s per GiB (0.1 s/GiB where memory is already backed). Paid
    at start, the KV cache's first writes leave the step loop; the cap keeps engine start bounded
    and what is left is mapped on first touch as before. Returns the blocks populated (of the
    cache's first dimension after K/V), counted from block 0.
    """
    if seconds <= 0 or not caches or caches[0].device.type != "cpu":
        return 0
    num_blocks = caches[0].shape[1]
    block_bytes = caches[0][0, 0].numel() * caches[0].element_size()
    chunk = max(1, CHUNK_BYTES_PER_LAYER // block_bytes)
    deadline = time.monotonic() + seconds
    chunks = _chunks(num_blocks, chunk)
    lock = threading.Lock()
    done = [0]  # blocks populated by every worker, in chunk order
    failure: list[str] = []

    def worker() -> None:
        while time.monotonic() < deadline and not failure:
            with lock:
                span = next(chunks, None)
            if span is None:
                return
            for cache in caches:
                for half in (0, 1):
                    start = cache[half, span[0]].data_ptr()
                    error = _populate(start, (span[1] - span[0]) * block_bytes)
                    if error:
                        failure.append(os.strerror(error))
                        return
            with lock:
                done[0] += span[1] - span[0]

    count = threads or torch.get_num_threads()
    pool = [threading.Thread(target=worker, name=f"kv-populate-{i}", daemon=True) for i in range(count)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    if failure:
        logger.warning("KV cache left to map on first use (populating failed: %s)", failure[0])
    return done[0]


def _chunks(num_blocks: int, chunk: int) -> Iterator[tuple[int, int]]:
    for first in range(0, num_blocks, chunk):
        yield first, min(first + chunk, num_blocks)


_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def _populate(address: int, nbytes: int) -> int:
    """madvise(MADV_POPULATE_WRITE) over the pages holding [address, address + nbytes); 0 or errno.

    ctypes drops the GIL for the call, so threads fault in parallel."""
    first = address // PAGE * PAGE
    last = -(-(address + nbytes) // PAGE) * PAGE
    if _libc.madvise(first, last - first, MADV_POPULATE_WRITE) == 0:
        return 0
    return ctypes.get_errno()
