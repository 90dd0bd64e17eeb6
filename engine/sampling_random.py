"""Counter-based randomness: the uniform of (seed, sample index, output position), batched.

A request's draw for its t-th output token of sample i is a pure function of (seed, i, t), so it
never depends on batch mates, step boundaries, preemption or the order requests arrived in, and
needs no per-request generator (one tensor expression for the whole batch).

The hash is a chain of 32-bit ``lowbias32`` finalizers (Wellons' integer hash; full avalanche).
It runs on int64 tensors that only ever hold 32-bit values, and each 32x32-bit multiply is split
into two 16x32-bit halves, so no intermediate exceeds 2**48: torch's int64 ops never overflow
(signed overflow is not something to rely on across backends).
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_MUL1 = 0x7FEB352D
_MUL2 = 0x846CA68B
_SALT = 0x9E3779B9  # golden ratio: keeps seed 0 away from the hash's fixed point 0
_INV_2_24 = 1.0 / (1 << 24)
SEED_MASK = (1 << 64) - 1


def split_seed(seed: int) -> tuple[int, int]:
    """A seed of any size (negative too) as its low and high 32-bit halves, modulo 2**64."""
    seed &= SEED_MASK
    return seed & _MASK32, seed >> 32


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x * constant) mod 2**32 for x in [0, 2**32), without int64 overflow."""
    low = (x & 0xFFFF) * constant
    high = (((x >> 16) * constant) & 0xFFFF) << 16
    return (low + high) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, _MUL1)
    x = x ^ (x >> 15)
    x = _mul32(x, _MUL2)
    return x ^ (x >> 16)


def hash32(
    seed_lo: torch.Tensor, seed_hi: torch.Tensor, index: torch.Tensor, position: torch.Tensor
) -> torch.Tensor:
    """32-bit hashes (as int64) of per-row (seed, sample index, position); all inputs int64 [N]."""
    h = _mix32(seed_lo ^ _SALT)
    h = _mix32(h ^ seed_hi)
    h = _mix32(h ^ (index & _MASK32))
    return _mix32(h ^ (position & _MASK32))


def uniforms(
    seed_lo: torch.Tensor, seed_hi: torch.Tensor, index: torch.Tensor, position: torch.Tensor
) -> torch.Tensor:
    """One float32 uniform in [0, 1) per row: the hash's top 24 bits (exact in float32)."""
    return (hash32(seed_lo, seed_hi, index, position) >> 8).to(torch.float32) * _INV_2_24
