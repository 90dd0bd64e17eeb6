"""Compile every Triton kernel of engine/gpu_kernels for a Hopper GPU (sm_90, the H100/H200 that
gpu_check.sh runs on) without one: Triton's own compiler down to a cubin, no launch. The interpreter
tests prove the kernels' arithmetic; this proves they compile (tensor-core dot shapes, loop-carried
types, early returns), in the variants the engine launches. Run in a process of its own, without
TRITON_INTERPRET (under it, @triton.jit gives interpreted functions the compiler cannot take).

    python tests/engine/triton_compile.py   # prints one line per variant, exits 1 on a failure
"""

from __future__ import annotations

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from bulkinfer.engine.gpu_kernels import layer_ops, paged_attention  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
FLOAT_ARGS = {"scale", "softcap", "eps"}
INT64_POINTERS = {"block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr", "slot_ptr", "experts_ptr"}
FP32_POINTERS = {"cos_ptr", "sin_ptr", "weights_ptr"}


def compile_variant(kernel: triton.runtime.jit.JITFunction, dtype: str, constexprs: dict[str, object],
                    **options: object) -> None:
    """Compile `kernel` with `dtype` tensors (pointers named *_ptr), 32-bit integer scalars and the
    given constexprs."""
    signature: dict[str, str] = {}
    for param in kernel.params:
        name = param.name
        if param.is_constexpr:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            wide = "*i64" if name in INT64_POINTERS else "*fp32" if name in FP32_POINTERS else None
            signature[name] = wide or f"*{dtype}"
        else:
            signature[name] = "fp32" if name in FLOAT_ARGS else "i32"
    triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs), target=TARGET,
                   options={"num_warps": 4, **options})


def attention(dtype: str, head_dim: int, group: int, window: int = 0, softcap: bool = False,
              fixed: bool = False, max_query_len: int = 1) -> dict[str, object]:
    block_m, tile = paged_attention.tile_shape(group, head_dim, max_query_len, fixed)
    return dict(GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_P=max(16, triton.next_power_of_2(head_dim)),
                BLOCK_SIZE=16, BLOCK_Q=block_m // group, BLOCK_M=block_m, TILE=tile, SLIDING_WINDOW=window,
                USE_SOFTCAP=softcap, IEEE=dtype == "fp32", WIDEN=False, ALIGNED=fixed)


ATTENTION = paged_attention._unified_attention
VARIANTS = [
    # SmolLM2's shape (9/3 heads of 64): a decode step, a prefill step, batch-invariant fp32
    ("attention bf16 gqa3 d64 decode", ATTENTION, "bf16", attention("bf16", 64, 3)),
    ("attention bf16 gqa3 d64 prefill", ATTENTION, "bf16",
     attention("bf16", 64, 3, max_query_len=512)),
    ("attention fp32 gqa3 d64 fixed", ATTENTION, "fp32", attention("fp32", 64, 3, fixed=True)),
    # the 1B shape (32/8 heads of 64), Mistral-style window over head_dim 128, Phi-3's 96, Gemma's 256
    ("attention bf16 gqa4 d64 prefill", ATTENTION, "bf16",
     attention("bf16", 64, 4, max_query_len=4096)),
    ("attention bf16 gqa4 d128 window", ATTENTION, "bf16", attention("bf16", 128, 4, 4096)),
    ("attention fp16 mha d96 softcap", ATTENTION, "fp16",
     attention("fp16", 96, 1, softcap=True)),
    ("attention bf16 gqa2 d256 window fixed", ATTENTION, "bf16",
     attention("bf16", 256, 2, 512, fixed=True)),
    ("store_kv bf16 d64", paged_attention._store_kv, "bf16",
     dict(KV_HEADS=3, HEAD_DIM=64, HEAD_DIM_P=64, BLOCK_SIZE=16, TOKENS=paged_attention.STORE_TOKENS)),
    ("add_rms_norm bf16", layer_ops._add_rms_norm_kernel, "bf16", dict(HAS_RESIDUAL=True, BLOCK=1024)),
    ("rope fp32", layer_ops._rope_kernel, "fp32", dict(BLOCK_H=4, BLOCK_D=32)),
    ("silu_and_mul bf16", layer_ops._silu_and_mul_kernel, "bf16", dict(BLOCK=1024)),
    ("moe_route bf16 top2", layer_ops._moe_route_kernel, "bf16",
     dict(TOP_K=2, NORMALIZE=True, BLOCK_E=8, BLOCK_K=2)),
    ("moe_shared_add bf16", layer_ops._moe_shared_add_kernel, "bf16", dict(BLOCK=1024)),
]


def main() -> int:
    failed = 0
    for name, kernel, dtype, constexprs in VARIANTS:
        try:
            compile_variant(kernel, dtype, constexprs)
            print(f"ok      {name}")
        except Exception as error:  # noqa: BLE001 - report every variant, then fail
            failed += 1
            print(f"FAILED  {name}: {type(error).__name__}: {str(error)[:2000]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
