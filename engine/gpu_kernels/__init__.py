"""Triton kernels for the engine on a GPU (and on CPU tensors under ``TRITON_INTERPRET=1``, which is
how CI checks them). Nothing here imports triton at package import: CPU workers never need it."""

from __future__ import annotations

import functools

# A step whose longest prefill chunk has at least this many tokens takes the attention kernel's
# larger tile (paged_attention.tile_shape); a fixed-shape step (mixed_graphs.py) stands for its
# chunks as this long or as one token.
LONG_QUERY = 64


@functools.cache
def triton_available() -> bool:
    """Whether triton imports here (installed and working): the engine's test before it picks a
    kernel of this package. Imported on the first call only, not at package import."""
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken install (missing libs, bad version) is "not available"
        return False
    return True
