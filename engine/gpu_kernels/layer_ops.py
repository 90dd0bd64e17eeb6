"""A decoder layer's element-wise ops in Triton, one launch each: the GPU counterpart of CpuKernels'
layer ops (engine/cpu_kernels/layer_ops.c, moe_ops.c), with the same method names and semantics, so
the model calls either through its modules' ``kernels`` (``LlamaForCausalLM.use_gpu_layer_ops``).

In PyTorch each op is several launches (a bf16 RMSNorm is an fp32 copy, the norm, a rounding copy
and a scale; the residual add one more), each a pass over memory; a decode step runs hundreds. Each
kernel computes in fp32 and rounds to the model dtype (bf16, fp16 or fp32) exactly where the PyTorch
path's tensor ops round, so results match it except in an fp32 intermediate's last place (a tree
sum instead of a sequential one, the GPU's exp). FMA contraction is off at every launch
(``enable_fp_fusion=False``): the PyTorch path rounds each product before its sum.

Every kernel is per row: a program reads and writes one row (one token, or one token's heads) and
never another's, with a block shape fixed by the row width alone, so a row's bits do not depend on
how many rows the step has. That is what ``batch_invariant`` needs; no fixed row blocks are needed.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_CHUNK = 1024  # elements per program in the row-chunked ops (SiLU*mul, the shared expert's add)
# Triton 3.9's interpreter truncates fp32 -> bf16 (numpy has no bf16); under it the rounding to
# nearest even is done on the bits. Compiled kernels round with the hardware's conversion.
_BF16_BY_BITS = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def _rounded(x, dtype: tl.constexpr):
    """fp32 ``x`` rounded to ``dtype`` (to nearest even), returned in fp32."""
    result = x.to(dtype).to(tl.float32)
    if _BF16_BY_BITS:  # compile-time: compiled kernels keep the conversion above alone
        if dtype == tl.bfloat16:
            bits = x.to(tl.int32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
            result = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))  # NaN stays NaN
    return result


@triton.jit
def _cast(x, dtype: tl.constexpr):
    """fp32 ``x`` rounded to ``dtype``, in ``dtype`` (what a store writes)."""
    return _rounded(x, dtype).to(dtype)


@triton.jit
def _add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, heads, x_row_stride, x_head_stride,
                         hidden, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    # Row r of x is x[r // heads, r % heads, :] (heads == 1 for a plain [rows, hidden] tensor; a q/k
    # norm reads the heads of a fused QKV output in place). residual and out are contiguous.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    dtype = out_ptr.dtype.element_ty
    value = tl.load(x_ptr + (row // heads) * x_row_stride + (row % heads) * x_head_stride + cols,
                    mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        # residual += x, rounded to the dtype as the in-place add rounds, and normalised from there
        residual = tl.load(residual_ptr + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
        value = _rounded(value + residual, dtype)
        tl.store(residual_ptr + row * hidden + cols, value.to(dtype), mask=mask)  # exact
    inverse = 1.0 / tl.sqrt(tl.sum(value * value, axis=0) / hidden + eps)
    # normalise, round to the dtype, then scale: transformers' order of roundings
    normalized = _rounded(value * inverse, dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * hidden + cols, _cast(normalized * weight, dtype), mask=mask)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, heads, row_stride, head_stride, half,
                 BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    dim = tl.arange(0, BLOCK_D)[None, :]
    mask = (head < heads) & (dim < half)
    dtype = x_ptr.dtype.element_ty
    cos = tl.load(cos_ptr + token * half + dim, mask=dim < half, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * half + dim, mask=dim < half, other=0.0).to(tl.float32)
    first = x_ptr + token * row_stride + head * head_stride + dim
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + half, mask=mask, other=0.0).to(tl.float32)
    # each product rounded, then the sum: apply_rope's tensor ops in the dtype
    out1 = _rounded(x1 * cos, dtype) - _rounded(x2 * sin, dtype)
    out2 = _rounded(x2 * cos, dtype) + _rounded(x1 * sin, dtype)
    tl.store(first, _cast(out1, dtype), mask=mask)
    tl.store(first + half, _cast(out2, dtype), mask=mask)


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, row_stride, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(gate_up_ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * row_stride + width + cols, mask=mask, other=0.0).to(tl.float32)
    silu = _rounded(gate / (1.0 + tl.exp(-gate)), dtype)  # F.silu rounds, then mul_ does
    tl.store(out_ptr + row * width + cols, _cast(silu * up, dtype), mask=mask)


@triton.jit
def _moe_route_kernel(logits_ptr, experts_ptr, weights_ptr, row_stride, num_experts,
                      TOP_K: tl.constexpr, NORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    expert = tl.arange(0, BLOCK_E)
    valid = expert < num_experts
    logits = tl.load(logits_ptr + row * row_stride + expert, mask=valid, other=float("-inf")).to(tl.float32)
    probs = tl.exp(logits - tl.max(logits, axis=0))
    probs = tl.where(valid, probs, 0.0)
    probs = probs / tl.sum(probs, axis=0)
    slot = tl.arange(0, BLOCK_K)
    chosen = tl.zeros([BLOCK_K], dtype=tl.int32)
    weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    taken = ~valid
    total = 0.0
    for k in tl.static_range(TOP_K):
        # The largest untaken probability, the lowest expert among equal ones (moe_ops.c's order;
        # torch.topk, the PyTorch path's, documents none). No hit (NaNs): the lowest untaken expert,
        # so a row always gets k distinct experts.
        best = tl.max(tl.where(taken, -1.0, probs), axis=0)
        pick = tl.min(tl.where(~taken & (probs == best), expert, BLOCK_E), axis=0)
        pick = tl.where(pick < BLOCK_E, pick, tl.min(tl.where(taken, BLOCK_E, expert), axis=0))
        weight = tl.sum(tl.where(expert == pick, probs, 0.0), axis=0)
        taken = taken | (expert == pick)
        chosen = tl.where(slot == k, pick, chosen)
        weights = tl.where(slot == k, weight, weights)
        total += weight  # in slot order
    if NORMALIZE:
        weights = weights / total
    tl.store(experts_ptr + row * TOP_K + slot, chosen.to(tl.int64), mask=slot < TOP_K)
    tl.store(weights_ptr + row * TOP_K + slot, weights, mask=slot < TOP_K)


@triton.jit
def _moe_shared_add_kernel(out_ptr, gate_ptr, shared_ptr, gate_stride, shared_stride, hidden,
                           BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(gate_ptr + row * gate_stride).to(tl.float32)
    sigmoid = _rounded(1.0 / (1.0 + tl.exp(-gate)), dtype)
    shared = tl.load(shared_ptr + row * shared_stride + cols, mask=mask, other=0.0).to(tl.float32)
    scaled = _rounded(shared * sigmoid, dtype)  # `out += sigmoid(gate) * shared`: 3 roundings
    out = tl.load(out_ptr + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * hidden + cols, _cast(out + scaled, dtype), mask=mask)


def _require(condition: bool, what: str) -> None:
    if not condition:
        raise ValueError(f"{what}: unsupported or inconsistent inputs")


def _norm_warps(block: int) -> int:
    return max(1, min(16, block // 512))


class TritonLayerOps:
    """CpuKernels' layer ops (``layer_ops_apply``, ``add_rms_norm``, ``rope_``, ``silu_and_mul``,
    ``moe_route``, ``moe_shared_add_``) in Triton, for CUDA tensors; with ``allow_cpu`` for CPU tensors
    too (under ``TRITON_INTERPRET=1``: the tests). It has none of CpuKernels' other methods."""

    def __init__(self, allow_cpu: bool = False) -> None:
        self.allow_cpu = allow_cpu

    def layer_ops_apply(self, tensor: torch.Tensor) -> bool:
        return tensor.dtype in DTYPES and (tensor.is_cuda or (self.allow_cpu and tensor.device.type == "cpu"))

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``norm(x)``; with ``residual``: ``residual += x`` in place, then ``(norm(residual),
        residual)``. x [..., hidden] (a [T, heads, dim] view with strided tokens read in place),
        residual x's shape and contiguous, weight [hidden]; one dtype."""
        hidden = x.shape[-1]
        _require(x.dtype == weight.dtype and x.dtype in DTYPES and weight.shape == (hidden,)
                 and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype
                                           and residual.is_contiguous())), "add_rms_norm")
        if x.dim() == 3 and x.stride(2) == 1:
            heads, row_stride, head_stride = x.shape[1], x.stride(0), x.stride(1)
        elif x.dim() == 2 and x.stride(1) == 1:
            heads, row_stride, head_stride = 1, x.stride(0), 0
        else:
            x = x.contiguous()
            heads, row_stride, head_stride = 1, hidden, 0
        weight = weight.contiguous()
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        rows = x.numel() // hidden if hidden else 0
        if rows:
            block = triton.next_power_of_2(hidden)
            _add_rms_norm_kernel[(rows,)](
                x, residual if residual is not None else out, weight, out, heads, row_stride, head_stride,
                hidden, eps, HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_norm_warps(block),
                enable_fp_fusion=False)
        return out if residual is None else (out, residual)

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary embedding of ``x [T, heads, dim]`` in place (tokens and heads may be strided, dims
        not); cos/sin [T, 1, dim / 2] in x's dtype."""
        tokens, heads, dim = x.shape
        half = dim // 2
        _require(x.dtype == cos.dtype == sin.dtype and x.dtype in DTYPES and x.stride(2) == 1
                 and dim % 2 == 0 and cos.numel() == sin.numel() == tokens * half, "rope_")
        cos, sin = cos.reshape(tokens, half).contiguous(), sin.reshape(tokens, half).contiguous()
        if tokens and heads:
            block_d = triton.next_power_of_2(half)
            block_h = min(triton.next_power_of_2(heads), max(1, 2048 // block_d))
            _rope_kernel[(tokens, triton.cdiv(heads, block_h))](
                x, cos, sin, heads, x.stride(0), x.stride(1), half, BLOCK_H=block_h, BLOCK_D=block_d,
                num_warps=4, enable_fp_fusion=False)
        return x

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of ``gate_up [rows, 2 * width]`` (gate first)."""
        _require(gate_up.dtype in DTYPES and gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0, "silu_and_mul")
        if gate_up.stride(1) != 1:
            gate_up = gate_up.contiguous()
        rows, width = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, width, dtype=gate_up.dtype, device=gate_up.device)
        if rows and width:
            _silu_and_mul_kernel[(rows, triton.cdiv(width, _CHUNK))](
                gate_up, out, gate_up.stride(0), width, BLOCK=_CHUNK, num_warps=4, enable_fp_fusion=False)
        return out

    def moe_route(self, logits: torch.Tensor, top_k: int,
                  normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(experts [rows, k] int64, weights [rows, k] fp32) of router ``logits [rows, experts]``:
        softmax in fp32, the top k in descending order (the lower expert first among equal
        probabilities, as moe_ops.c), renormalised to sum to 1 where ``normalize``. No host reads
        (a CUDA graph can record it)."""
        _require(logits.dtype in DTYPES and logits.dim() == 2 and 0 < top_k <= logits.shape[1], "moe_route")
        if logits.stride(1) != 1:
            logits = logits.contiguous()
        rows, num_experts = logits.shape
        chosen = torch.empty(rows, top_k, dtype=torch.int64, device=logits.device)
        weights = torch.empty(rows, top_k, dtype=torch.float32, device=logits.device)
        if rows:
            block_e = triton.next_power_of_2(num_experts)
            _moe_route_kernel[(rows,)](
                logits, chosen, weights, logits.stride(0), num_experts, TOP_K=top_k,
                NORMALIZE=bool(normalize), BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k),
                num_warps=max(1, min(4, block_e // 64)), enable_fp_fusion=False)
        return chosen, weights

    def moe_shared_add_(self, out: torch.Tensor, gate: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
        """``out += sigmoid(gate) * shared`` in place (out contiguous, shared [rows, hidden]; gate
        [rows, 1]; one dtype), rounding after each op as that tensor expression does."""
        _require(out.dtype == gate.dtype == shared.dtype and out.dtype in DTYPES and out.is_contiguous()
                 and out.dim() == 2 and shared.shape == out.shape and gate.shape == (out.shape[0], 1),
                 "moe_shared_add_")
        if shared.stride(1) != 1:
            shared = shared.contiguous()
        rows, hidden = out.shape
        if rows and hidden:
            _moe_shared_add_kernel[(rows, triton.cdiv(hidden, _CHUNK))](
                out, gate, shared, gate.stride(0), shared.stride(0), hidden, BLOCK=_CHUNK, num_warps=4,
                enable_fp_fusion=False)
        return out


__all__ = ["DTYPES", "TritonLayerOps"]
