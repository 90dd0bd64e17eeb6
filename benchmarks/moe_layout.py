"""Expert weight layouts on CPU: one engine ``Linear`` per expert (oneDNN with a packed weight, the
row kernel for single-token rows) against one ``[E, 2I, H]`` / ``[E, H, I]`` tensor per layer with
``F.linear`` on each expert's slice (transformers' layout), and against the fixed-shape path's
``torch._grouped_mm`` over those tensors (engine/models/moe_fixed_shape.py: what a CUDA graph records).

`python -m bulkinfer.benchmarks.moe_layout [--hidden 512 --width 1792 --experts 8 --top-k 2]` times one sparse
block's grouped experts (routing excluded, the same routing for both) at decode-size batches (rows
that are all single-token rows) and prefill-size batches, in fp32 and bf16, and prints ms per call.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F

from bulkinfer.engine import cpu_kernels
from bulkinfer.engine.models.layers import Linear, onednn_linear_available
from bulkinfer.engine.models.llama_config import LlamaFamilyConfig
from bulkinfer.engine.models.moe_fixed_shape import fixed_shape_expert_outputs
from bulkinfer.engine.models.sparse_moe import MoeConfig, SparseMoeBlock
from bulkinfer.engine.models.step_rows import StepRows


def _block(hidden: int, width: int, experts: int, top_k: int, dtype: torch.dtype) -> SparseMoeBlock:
    base = LlamaFamilyConfig.from_hf_dict("MixtralForCausalLM", {
        "vocab_size": 32, "hidden_size": hidden, "intermediate_size": width, "num_hidden_layers": 1,
        "num_attention_heads": 8, "num_key_value_heads": 8})
    config = MoeConfig(**{name: getattr(base, name) for name in base.__dataclass_fields__},
                       num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=width,
                       routing_weights_in_fp32=True, sparse_layers=(True,), mixtral_names=True)
    block = SparseMoeBlock(config, StepRows())
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * param.shape[-1] ** -0.5)
    return block.to(dtype).requires_grad_(False)


def _engine_layout(block: SparseMoeBlock, dtype: torch.dtype) -> None:
    kernels = cpu_kernels.load()
    for module in block.modules():
        if isinstance(module, Linear):
            if onednn_linear_available(torch.device("cpu"), dtype):
                module.pack_for_onednn()
            module.use_row_gemm(kernels, block.expert_rows)
        if hasattr(module, "kernels"):
            cast(Any, module).kernels = kernels


def _stacked_experts(block: SparseMoeBlock, x: torch.Tensor, experts: torch.Tensor,
                     weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The same grouping over [E, 2I, H] / [E, H, I] tensors, one F.linear per expert's slice."""
    rows, top_k = experts.shape
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    inputs = x.index_select(0, order // top_k)
    outputs = torch.empty_like(inputs)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            g, u = F.linear(inputs[start:start + count], gate_up[expert]).chunk(2, dim=-1)
            outputs[start:start + count] = F.linear(F.silu(g) * u, down[expert])
            start += count
    weighted = (outputs.float() * weights.reshape(-1).index_select(0, order)[:, None]).to(x.dtype)
    return torch.empty_like(weighted).index_copy_(0, order, weighted).view(rows, top_k, -1).sum(dim=1)


def _grouped_mm_experts(block: SparseMoeBlock, x: torch.Tensor, experts: torch.Tensor,
                        weights: torch.Tensor) -> torch.Tensor:
    outputs, order = fixed_shape_expert_outputs(x, experts, block.experts_gate_up, block.experts_down)
    return block.combine(outputs, order, weights, x)


def _time(fn: Callable[..., torch.Tensor], args: tuple, repeats: int) -> float:
    fn(*args)
    started = time.perf_counter()
    for _ in range(repeats):
        fn(*args)
    return (time.perf_counter() - started) / repeats * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bulkinfer.benchmarks.moe_layout", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--width", type=int, default=1792)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--rows", default="1,16,64,512,2048", help="batch sizes (tokens) to time")
    args = parser.parse_args(argv)
    print(f"hidden {args.hidden}, expert width {args.width}, {args.experts} experts, top-{args.top_k}; "
          f"torch threads {torch.get_num_threads()}; ms per call of the grouped experts")
    print(f"{'dtype':<10}{'rows':>6}{'per-expert Linear':>20}{'[E,2I,H] F.linear':>20}{'grouped_mm':>12}")
    for dtype in (torch.float32, torch.bfloat16):
        block = _block(args.hidden, args.width, args.experts, args.top_k, dtype)
        gate_up, down = block.experts_gate_up, block.experts_down
        _engine_layout(block, dtype)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, args.hidden, generator=torch.Generator().manual_seed(rows)).to(dtype)
            with torch.inference_mode():
                experts, weights = block.route(x)
            decode = rows <= 64  # decode-size batches: every row a single-token row
            block.step_rows.single = rows if decode else 0
            repeats = max(3, 2000 // rows)
            with torch.inference_mode():
                ours = _time(block.grouped_experts, (x, experts, weights), repeats)
                stacked = _time(_stacked_experts, (block, x, experts, weights, gate_up, down), repeats)
                grouped = _time(_grouped_mm_experts, (block, x, experts, weights), repeats)
            print(f"{str(dtype).removeprefix('torch.'):<10}{rows:>6}{ours:>20.3f}{stacked:>20.3f}{grouped:>12.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
