"""Whether an engine runs its attention (and the layers' elementwise ops) through the Triton kernels,
and the attention backend that follows. Imports triton only when the answer is yes."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from bulkinfer.engine.attention import AttentionBackend, TorchPagedAttention
from bulkinfer.engine.gpu_kernels import triton_available

if TYPE_CHECKING:
    from bulkinfer.engine.cpu_kernels import CpuKernels


def use_triton_kernels(setting: bool | None, device_type: str) -> bool:
    """The ``triton_kernels`` setting resolved: None = on a CUDA device where triton is installed
    (CPUs keep their native kernels, which Triton does not compile for); True = wherever asked (on
    a CPU only under ``TRITON_INTERPRET=1``: how CI runs the engine through the kernels)."""
    if setting is False or (setting is None and device_type != "cuda"):
        return False
    if not triton_available():
        if setting:
            raise ValueError("triton_kernels=true needs the triton package (pip install triton)")
        return False
    if device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"triton_kernels=true on device {device_type!r} needs TRITON_INTERPRET=1 "
                         "(Triton compiles for GPUs; its interpreter runs them on CPU tensors, slowly)")
    return True


def build_attention_backend(use_triton: bool, kernels: CpuKernels | None, batch_invariant: bool
                            ) -> AttentionBackend:
    if use_triton:
        from bulkinfer.engine.gpu_kernels.attention_backend import TritonPagedAttention

        return TritonPagedAttention(batch_invariant=batch_invariant)
    return TorchPagedAttention(kernels=kernels, batch_invariant=batch_invariant)


def use_triton_layer_ops(model: object, use_triton: bool) -> None:
    """Norms, rotary, the MLP activation and MoE routing through Triton where the engine's attention
    runs there (a model family without the switch keeps PyTorch's)."""
    if use_triton and hasattr(model, "use_gpu_layer_ops"):
        from bulkinfer.engine.gpu_kernels.layer_ops import TritonLayerOps

        model.use_gpu_layer_ops(TritonLayerOps(allow_cpu=True))  # CPU tensors: only under the interpreter
