"""How a model's checkpoint tensors split across tensor-parallel ranks.

Each model class returns ``tensor_parallel_plan()``: checkpoint (Hugging Face) tensor name ->
``Split``. A tensor it does not name is replicated (norms, routers). The loader reads each rank's
part of every tensor straight from the safetensors file (``get_slice``), so a rank never holds the
whole model, and the model is built from ``local_config``: the same class with 1/N of the heads,
KV heads and intermediate size.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class TensorParallelConfigError(ValueError):
    """The model's shapes cannot be split over this many ranks; the message says which and why."""


@dataclass(frozen=True)
class Split:
    """How one checkpoint tensor is cut.

    ``dim``: the dimension cut into N contiguous parts (rank r takes part r); None keeps it whole.
    ``sections``: a fused tensor (Phi-3's qkv: q, k, v one after the other along ``dim``): each
    section is cut on its own and a rank's parts are concatenated in order.
    ``unit``: cut only between whole units (a head is ``head_dim`` rows). Where a section has fewer
    units than ranks (4 ranks, 2 KV heads), each unit is replicated: rank r takes unit r * units // N.
    ``pad``: the size need not divide by N (a vocabulary): each rank takes ceil(size / N) rows, the
    last padded with zeros.
    ``reduce_at``: the module (name inside the model) whose output, computed from this rank's part
    of this weight, is a partial sum: it is all-reduced across the ranks (row-parallel layers).
    ``first_rank_only``: a bias added after a row-parallel product: rank 0 keeps it, the others
    hold zeros, so the all-reduce adds it once.
    """

    dim: int | None
    sections: tuple[int, ...] = ()
    unit: int = 1
    pad: bool = False
    reduce_at: str | None = None
    first_rank_only: bool = False


class TensorSource(Protocol):
    """A safetensors slice (``safe_open(...).get_slice(name)``) or a plain tensor."""

    def __getitem__(self, index: Any) -> torch.Tensor: ...


def unit_range(units: int, rank: int, world: int, what: str) -> tuple[int, int]:
    """[first, last) units of `units` that `rank` holds: an equal share, or one replicated unit
    where there are fewer units than ranks."""
    if units >= world:
        if units % world:
            raise TensorParallelConfigError(f"{what}: {units} cannot be split evenly over "
                                            f"tensor_parallel_size={world}")
        share = units // world
        return rank * share, (rank + 1) * share
    if world % units:
        raise TensorParallelConfigError(f"{what}: {units} cannot be replicated evenly over "
                                        f"tensor_parallel_size={world} (it must divide it)")
    first = rank * units // world
    return first, first + 1


def padded_share(size: int, world: int) -> int:
    """Rows per rank of a padded split (a vocabulary): ceil(size / world)."""
    return -(-size // world)


def shard(source: TensorSource, shape: tuple[int, ...], split: Split | None, rank: int, world: int,
          name: str) -> torch.Tensor:
    """`rank`'s part of the tensor `name` of `shape`, read from `source` (only that part is read)."""
    if split is None:
        return source[:] if shape else source[()]
    if split.first_rank_only:
        whole = source[:]
        return whole if rank == 0 else torch.zeros_like(whole)
    if split.dim is None:
        return source[:]
    dim = split.dim
    lead = (slice(None),) * dim
    size = shape[dim]
    if split.pad:
        share = padded_share(size, world)
        first, last = min(rank * share, size), min((rank + 1) * share, size)
        part = source[(*lead, slice(first, last))]
        missing = share - (last - first)
        if missing:
            pad_shape = list(part.shape)
            pad_shape[dim] = missing
            part = torch.cat([part, torch.zeros(pad_shape, dtype=part.dtype)], dim=dim)
        return part
    sections = split.sections or (size,)
    if sum(sections) != size:
        raise TensorParallelConfigError(f"{name}: sections {sections} do not add up to its size {size}")
    parts = []
    offset = 0
    for section in sections:
        if section % split.unit:
            raise TensorParallelConfigError(f"{name}: a section of {section} is not whole units of "
                                            f"{split.unit}")
        first, last = unit_range(section // split.unit, rank, world, name)
        parts.append(source[(*lead, slice(offset + first * split.unit, offset + last * split.unit))])
        offset += section
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


# Config fields that count heads or channels each rank holds a share of (a field a config lacks is
# skipped: MoE configs add their expert width).
_SHARED_FIELDS = ("num_heads", "num_kv_heads", "intermediate_size", "moe_intermediate_size",
                  "shared_expert_intermediate_size")


def local_config(config: Any, world: int) -> Any:
    """The config a rank builds its part of the model from: 1/`world` of the heads (one KV head
    where there are fewer than ranks), of each MLP's width, and of the vocabulary (padded)."""
    if world == 1:
        return config
    changes: dict[str, int] = {}
    names = {f.name for f in dataclasses.fields(config)}
    for field_name in _SHARED_FIELDS:
        value = getattr(config, field_name, None) if field_name in names else None
        if not value:
            continue
        first, last = unit_range(int(value), 0, world, f"{field_name}")
        changes[field_name] = last - first
    changes["vocab_size"] = padded_share(config.vocab_size, world)
    return dataclasses.replace(config, **changes)


def check_splittable(config: Any, world: int) -> None:
    """Raise TensorParallelConfigError (naming the field) where `config` cannot be split over
    `world` ranks: before any rank process starts."""
    local_config(config, world)
    if config.num_heads < world:
        raise TensorParallelConfigError(f"num_heads: {config.num_heads} attention heads cannot be split over "
                                        f"tensor_parallel_size={world}")
