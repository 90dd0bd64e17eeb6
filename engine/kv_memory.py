"""Memory for paged KV caches.

On CPU the cache comes from an anonymous memory map: the OS hands out zero pages as they are first
touched, so engine start does not write the whole cache (zeroing 4 GiB took 0.5-5 s of a start on
these VMs, the larger figures when the host was under memory pressure) and the process holds only
the blocks a job has used. Zeros still matter: attention paths multiply masked slots by a
probability of 0, and 0 x NaN garbage would be NaN.
"""

from __future__ import annotations

import math
import mmap

import torch

from engine.models.llama import LlamaFamilyConfig


def allocate_kv_caches(config: LlamaFamilyConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device) -> list[torch.Tensor]:
    """One zeroed ``[2, num_blocks, kv_heads, block_size, head_dim]`` cache per layer (K and V)."""
    shape = (2, num_blocks, config.num_kv_heads, block_size, config.head_dim)
    return [zeroed_kv_cache(shape, dtype, device) for _ in range(config.num_layers)]


def zeroed_kv_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled tensor of `shape`; on CPU its pages are mapped on first touch."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    buffer = mmap.mmap(-1, nbytes)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        # 2 MiB pages where the kernel grants them (transparent huge pages in "madvise" mode, the
        # usual default): a first write maps 512x the memory per fault and K/V reads miss the TLB
        # less. Our 2-core VMs grant none (thp_fault_alloc stays put); there first writes cost
        # 0.3 s/GiB on pages the VM backed before and ~3 s/GiB on fresh ones (just after a load).
        buffer.madvise(mmap.MADV_HUGEPAGE)
    # The tensor keeps the map alive; it is unmapped when the last view of the cache goes.
    return torch.frombuffer(buffer, dtype=dtype).view(shape)
