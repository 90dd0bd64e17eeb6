"""cuBLAS settings a batch-invariant engine on CUDA needs besides fixed shapes.

Fixed shapes make cuBLAS pick the same algorithm every call; what it may still do within one:
- reduce bf16/fp16 GEMMs in reduced precision, and split K (PyTorch's
  ``allow_{bf16,fp16}_reduced_precision_reduction``; since pytorch/pytorch#164766 a tuple
  ``(reduced_precision, split_k)`` turns split-K off too, where a plain False leaves it allowed);
- run fp32 GEMMs in TF32 (``allow_tf32``), which would also part from the CPU's fp32;
- pick a workspace per stream: cuBLAS documents bitwise-reproducible results run to run only with a
  fixed workspace configuration (``CUBLAS_WORKSPACE_CONFIG=:4096:8``, read when cuBLAS's handle is
  first made, so it is set before the model's first GEMM).
They are process-wide: an engine with batch invariance sets them for every engine of its process.
"""

from __future__ import annotations

import os

import torch

WORKSPACE_ENV = "CUBLAS_WORKSPACE_CONFIG"
WORKSPACE_CONFIG = ":4096:8"


def use_invariant_cuda_settings() -> None:
    """Set the process's cuBLAS options for batch invariance (see the module's docstring); an
    explicit ``CUBLAS_WORKSPACE_CONFIG`` already in the environment is kept."""
    os.environ.setdefault(WORKSPACE_ENV, WORKSPACE_CONFIG)
    matmul = torch.backends.cuda.matmul
    matmul.allow_tf32 = False
    try:
        matmul.allow_bf16_reduced_precision_reduction = (False, False)
        matmul.allow_fp16_reduced_precision_reduction = (False, False)
    except (TypeError, ValueError):  # a PyTorch before the split-K option: the bool alone
        matmul.allow_bf16_reduced_precision_reduction = False
        matmul.allow_fp16_reduced_precision_reduction = False


__all__ = ["WORKSPACE_CONFIG", "WORKSPACE_ENV", "use_invariant_cuda_settings"]
