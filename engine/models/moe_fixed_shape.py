"""The sparse MoE block's experts with fixed shapes and no host reads: what a CUDA graph records.

The eager grouped path (moe.py ``SparseMoeBlock.grouped_experts``) reads each expert's row count on
the host to slice its rows, which a captured graph cannot do (the counts change at every replay).
Here every shape follows from the step's row count alone: the (row, slot) pairs are sorted by
expert on the device (stable, as the eager path sorts them), each expert's row count is a
scatter-add (``bincount`` would read its maximum on the host), and ``torch._grouped_mm`` runs each
expert's rows against its slice of the stacked ``[E, 2I, H]`` / ``[E, H, I]`` weights, taking the
cumulative counts as a device tensor. One call per projection for every expert at once.

Where the kernel keeps the offsets on the device: CUDA, bf16, compute capability 9.0+ (CUTLASS).
Elsewhere (CPU; fp32 or fp16 on CUDA) torch runs it as a loop of matmuls that copies the offsets to
the host: correct, but not recordable on a GPU, so those models keep eager decode steps there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_ALIGNMENT_BYTES = 16  # grouped_mm wants every operand's leading stride a multiple of 16 bytes


def grouped_mm_fits(dtype: torch.dtype, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether grouped_mm takes inputs of `dtype` against these stacked weights: the same dtype,
    and hidden and expert widths whose rows are whole 16-byte units (a tensor-parallel share of an
    odd width may not be: that block keeps the eager path)."""
    if gate_up.dtype != dtype or down.dtype != dtype:
        return False
    hidden, width = down.shape[1], down.shape[2]
    return all(size * gate_up.element_size() % _ALIGNMENT_BYTES == 0 for size in (hidden, width))


def grouped_mm_records(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether grouped_mm on this device and dtype runs without copying its offsets to the host
    (so a CUDA graph can record it). On a CPU nothing is recorded: the question does not arise."""
    if device.type == "cpu":
        return True
    if device.type != "cuda" or dtype != torch.bfloat16:
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def fixed_shape_expert_outputs(x: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor,
                               down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(each (row, slot) pair's expert output, in expert order; that order) for routing
    `experts` [T, k] over stacked weights `gate_up` [E, 2I, H] and `down` [E, H, I].

    The same pairs in the same order as the eager path, so the two combine their outputs alike."""
    rows, top_k = experts.shape
    num_experts, width = down.shape[0], down.shape[2]
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs by expert, each expert's in row order
    counts = torch.zeros(num_experts, dtype=torch.long, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    ends = counts.cumsum(0).to(torch.int32)  # grouped_mm's offs: where each expert's rows end
    inputs = x.index_select(0, order // top_k)
    # Weights as stored ([E, out, in]), read transposed: each expert's Linear weight, as F.linear does.
    gate_up_out = torch._grouped_mm(inputs, gate_up.transpose(1, 2), offs=ends)
    gate, up = gate_up_out.split(width, dim=-1)
    hidden = F.silu(gate).mul_(up)
    return torch._grouped_mm(hidden, down.transpose(1, 2), offs=ends), order


__all__ = ["fixed_shape_expert_outputs", "grouped_mm_fits", "grouped_mm_records"]
