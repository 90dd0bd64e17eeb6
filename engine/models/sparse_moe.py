"""The sparse MoE block: a router that picks ``top_k`` of ``num_experts`` expert MLPs per token,
plus (Qwen2-MoE) a shared expert scaled by its own sigmoid gate; the MoE decoders
(engine/models/moe.py) put one in each sparse layer, with its config (``MoeConfig``). It lives
apart from the decoders so the native decode path can read it without importing a model.

Experts run grouped: a step's (token, slot) pairs are sorted by expert (stably, so each expert's rows
keep the batch's order, single-token rows first) and each expert with rows runs them as one matmul
per projection. Each expert is an ordinary fused MLP of the engine's ``Linear`` layers, so its rows
take the same kernels as a dense MLP's: oneDNN with a packed weight for prefill rows, the row kernel
for single-token rows (each row computed alone: a decode row gets the same bits in any batch).
Measured on CPU against one ``[E, 2I, H]`` / ``[E, H, I]`` tensor per layer through ``F.linear`` of
each expert's slice (benchmarks/moe_layout.py, docs/engine.md): faster in bf16 at every batch size
(1.2-1.8x) and in fp32 from 32 rows to 512 (2x at 32-64), slower only in fp32 at 1-8 rows (0.1 ms)
and 2048 (11%).

Each layer's expert weights live once, as one ``[E, 2I, H]`` (gate and up) and one ``[E, H, I]``
(down) tensor, transformers' and vLLM's layout; each expert's ``Linear`` weight is a view into them.
The eager path reads the views; decode steps on the fixed-shape path (CUDA graphs) read the stacked
tensors through ``torch._grouped_mm`` (moe_fixed_shape.py), whose shapes do not depend on routing.

Routing follows transformers bit for bit in the ops that decide it: router logits in the model's
dtype, softmax in fp32, top-k, the checkpoint's renormalisation (Qwen ``norm_topk_prob``; Mixtral
always), and each pair's weighted output rounded to the model dtype where transformers rounds it.
On CPU with the native kernels, the softmax, top-k (the lower expert first among ties) and the shared
expert's sigmoid gate run on moe_ops.c, the kernels the native decode path (decode_layers.c) uses, so
both paths give the same bits; torch's own differ from them in the last bits of an exp.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from bulkinfer.engine.cpu_kernels import CpuKernels
from bulkinfer.engine.invariant import in_row_blocks
from bulkinfer.engine.models.layers import MLP, Linear
from bulkinfer.engine.models.llama_config import LlamaFamilyConfig, UnsupportedModelError
from bulkinfer.engine.models.module_list import ModuleSeq
from bulkinfer.engine.models.moe_fixed_shape import (
    fixed_shape_expert_outputs,
    grouped_mm_fits,
    grouped_mm_records,
)
from bulkinfer.engine.models.step_rows import StepRows

if TYPE_CHECKING:
    from bulkinfer.engine.gpu_kernels.layer_ops import TritonLayerOps

# Where each family keeps its sparse block's tensors, and its experts' (gate, up, down) names.
QWEN_NAMES = ("mlp", ("gate_proj", "up_proj", "down_proj"))
MIXTRAL_NAMES = ("block_sparse_moe", ("w1", "w3", "w2"))


@dataclass
class StepShape:
    """Whether the current forward is a step on the fixed-shape path (decode_graphs.py, mixed_graphs.py),
    where every op must keep its shapes and never read the device from the host. Set by the model
    at the start of each forward, read by its sparse blocks."""

    fixed: bool = False


@dataclass(frozen=True)
class MoeConfig(LlamaFamilyConfig):
    """A Llama-family config plus the sparse MLP's fields (HF names in the comments)."""

    num_experts: int = 0  # num_experts (Qwen) / num_local_experts (Mixtral)
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's width (Mixtral: intermediate_size)
    norm_topk_prob: bool = True  # renormalise the top-k probabilities to sum to 1
    # Mixtral multiplies each expert's output by its fp32 weight and rounds the product once; Qwen
    # rounds the weight to the model dtype first.
    routing_weights_in_fp32: bool = False
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: a shared expert beside the routed ones
    # One entry per layer: whether its MLP is sparse (decoder_sparse_step, mlp_only_layers).
    sparse_layers: tuple[bool, ...] = ()
    mixtral_names: bool = False  # block_sparse_moe.experts.N.w1/w2/w3 instead of mlp.experts.N.*_proj

    @property
    def tensor_names(self) -> tuple[str, tuple[str, str, str]]:
        return MIXTRAL_NAMES if self.mixtral_names else QWEN_NAMES

    @staticmethod
    def from_hf_dict(architecture: str, cfg: dict[str, Any]) -> MoeConfig:
        base = LlamaFamilyConfig.from_hf_dict(architecture, cfg)
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(LlamaFamilyConfig)}
        num_layers = base.num_layers
        if architecture == "MixtralForCausalLM":
            num_experts = int(cfg.get("num_local_experts") or 0)
            sparse = (True,) * num_layers
            fields.update(sliding_windows=(cfg.get("sliding_window"),) * num_layers)
            extra: dict[str, Any] = dict(moe_intermediate_size=base.intermediate_size, norm_topk_prob=True,
                         routing_weights_in_fp32=True, mixtral_names=True)
        else:
            num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
            step = int(cfg.get("decoder_sparse_step") or 1)
            dense = set(cfg.get("mlp_only_layers") or ())
            sparse = tuple(num_experts > 0 and i not in dense and (i + 1) % step == 0
                           for i in range(num_layers))
            extra = dict(moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                         norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                         shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0))
            if architecture == "Qwen3MoeForCausalLM":
                # transformers applies the window to every layer, where use_sliding_window is on.
                window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
                fields.update(qk_norm=True, sliding_windows=(window,) * num_layers)
            else:  # Qwen2-MoE: q/k/v bias per config (default on), o_proj never
                fields.update(qkv_bias=bool(cfg.get("qkv_bias", True)), o_bias=False)
        top_k = int(cfg.get("num_experts_per_tok") or 0)
        if any(sparse) and not 0 < top_k <= num_experts:
            raise UnsupportedModelError(
                f"num_experts_per_tok={top_k} must be between 1 and the number of experts ({num_experts})")
        return MoeConfig(**fields, num_experts=num_experts, num_experts_per_tok=top_k,
                         sparse_layers=sparse, **extra)


class SparseMoeBlock(nn.Module):
    """Router + top-k experts (+ shared expert) over a flat batch of rows."""

    kernels: CpuKernels | TritonLayerOps | None = None  # use_cpu_kernels / use_gpu_layer_ops
    # Batch invariance without the native kernels: the shared expert's gate in fixed row blocks (fp32
    # sigmoid rounds a call's last elements on a scalar path), no grouped_mm (CUTLASS tiles by each
    # expert's row count); the experts' own projections are Linears with their own blocks.
    fixed_row_blocks: bool = False

    @property
    def grouped_mm_allowed(self) -> bool:
        """Whether the fixed-shape path may run the experts through grouped_mm: not with batch
        invariance and no native CPU kernels (with them, the CPU keeps its existing paths; Triton's
        layer ops leave the experts' matmuls to grouped_mm, so they count as none)."""
        return not (self.fixed_row_blocks and not isinstance(self.kernels, CpuKernels))

    def __init__(self, config: MoeConfig, step_rows: StepRows, step_shape: StepShape | None = None) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.routing_weights_in_fp32 = config.routing_weights_in_fp32
        self.gate = Linear(config.hidden_size, config.num_experts, bias=False)
        expert_config = dataclasses.replace(config, intermediate_size=config.moe_intermediate_size,
                                            mlp_bias=False)
        self.experts: ModuleSeq[MLP] = ModuleSeq(MLP(expert_config) for _ in range(config.num_experts))
        # The experts' weights, stored once (the experts' Linears hold views: _view_expert_weights).
        self.experts_gate_up = _stacked([expert.gate_up_proj for expert in self.experts])
        self.experts_down = _stacked([expert.down_proj for expert in self.experts])
        self._view_expert_weights()
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: Linear | None = None
        if config.shared_expert_intermediate_size:
            shared_config = dataclasses.replace(
                config, intermediate_size=config.shared_expert_intermediate_size, mlp_bias=False)
            self.shared_expert = MLP(shared_config)
            self.shared_expert_gate = Linear(config.hidden_size, 1, bias=False)
        self.step_rows = step_rows  # the model's: how many leading rows of `x` are single-token rows
        # The experts' own: set before each expert runs, to how many of its rows are single-token rows.
        self.expert_rows = StepRows()
        self.step_shape = step_shape or StepShape()  # the model's: whether this step has fixed shapes

    def _view_expert_weights(self) -> None:
        """Point each expert's Linear weight at its slice of the stacked tensors (plain tensors,
        not parameters: the stacked ones are the block's only copy, and what dtype and device moves
        convert)."""
        for index, expert in enumerate(self.experts):
            for linear, stacked in ((expert.gate_up_proj, self.experts_gate_up),
                                    (expert.down_proj, self.experts_down)):
                linear._parameters.pop("weight", None)
                linear.weight = stacked.detach()[index]

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202 (nn.Module's signature)
        # .to(dtype), .to_empty(device), .cuda() replace the stacked tensors: views follow them.
        super()._apply(fn, recurse)
        self._view_expert_weights()
        return self

    def fixed_shape_records(self) -> bool:
        """Whether this block's fixed-shape forward runs without host reads on its device and dtype
        (so a CUDA graph can record it)."""
        weights = self.experts_gate_up
        return (grouped_mm_fits(weights.dtype, weights, self.experts_down)
                and grouped_mm_records(weights.device, weights.dtype))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(experts [T, k], weights [T, k]) per row, as transformers computes them."""
        logits = self.gate(x)
        if self.kernels is not None and self.kernels.layer_ops_apply(logits):
            # On CPU the kernel the native decode path routes with (moe_ops.c), so both give the same
            # bits: torch's softmax exp and its top-k's order among ties cannot be matched from C.
            experts, weights = self.kernels.moe_route(logits, self.top_k, self.norm_topk_prob)
        else:
            probs = torch.softmax(logits.float(), dim=-1)
            weights, experts = torch.topk(probs, self.top_k, dim=-1)
            if self.norm_topk_prob:
                weights /= weights.sum(dim=-1, keepdim=True)
        return experts, weights if self.routing_weights_in_fp32 else weights.to(x.dtype)

    def add_shared_expert(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """out += sigmoid(shared_expert_gate(x)) * shared_expert(x), in place (on CPU through the
        kernel the native decode path uses: torch's sigmoid exp cannot be matched from C)."""
        assert self.shared_expert is not None and self.shared_expert_gate is not None
        gate, shared = self.shared_expert_gate(x), self.shared_expert(x)
        if self.kernels is not None and self.kernels.layer_ops_apply(out) and out.is_contiguous():
            self.kernels.moe_shared_add_(out, gate, shared)
        elif self.fixed_row_blocks:
            out += in_row_blocks(torch.sigmoid, gate) * shared
        else:
            out += torch.sigmoid(gate) * shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(x)
        grouped_mm = self.grouped_mm_allowed and grouped_mm_fits(x.dtype, self.experts_gate_up,
                                                                 self.experts_down)
        if self.step_shape.fixed and grouped_mm:
            outputs, order = fixed_shape_expert_outputs(x, experts, self.experts_gate_up, self.experts_down)
            out = self.combine(outputs, order, weights, x)
        else:
            out = self.grouped_experts(x, experts, weights)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            self.add_shared_expert(out, x)
        # The block's output is complete here (tensor parallel: the one place to all-reduce).
        return out

    def grouped_experts(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """sum over k of weights[t, k] * expert[experts[t, k]](x[t]), each expert's rows as one batch."""
        rows, top_k = experts.shape
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # pairs by expert, each expert's in row order
        row_of = order // top_k
        by_expert = flat.index_select(0, order)
        counts = torch.bincount(by_expert, minlength=self.num_experts)
        single = torch.bincount(by_expert[row_of < self.step_rows.single], minlength=self.num_experts)
        inputs = x.index_select(0, row_of)
        outputs = torch.empty_like(inputs)
        start = 0
        for expert, (count, num_single) in enumerate(zip(counts.tolist(), single.tolist(), strict=True)):
            if count:
                self.expert_rows.single = num_single
                outputs[start:start + count] = self.experts[expert](inputs[start:start + count])
                start += count
        return self.combine(outputs, order, weights, x)

    def combine(self, outputs: torch.Tensor, order: torch.Tensor, weights: torch.Tensor,
                x: torch.Tensor) -> torch.Tensor:
        """Each row's routing-weighted sum of its pairs' expert `outputs` (given in `order`)."""
        rows, top_k = weights.shape
        pair_weights = weights.reshape(-1).index_select(0, order)[:, None]
        if self.routing_weights_in_fp32:
            weighted = (outputs.float() * pair_weights).to(x.dtype)
        else:
            weighted = outputs.mul_(pair_weights)
        by_pair = torch.empty_like(weighted).index_copy_(0, order, weighted)
        # The k contributions in slot order: a row's sum never depends on what else the step holds.
        return by_pair.view(rows, top_k, x.shape[-1]).sum(dim=1)


def _stacked(linears: list[Linear]) -> nn.Parameter:
    weights = [linear.weight.detach() for linear in linears]
    if weights[0].is_meta:  # the loaders' build: no values to copy (a stack on meta imports torch._dynamo)
        return nn.Parameter(torch.empty((len(weights), *weights[0].shape), dtype=weights[0].dtype,
                                        device="meta"), requires_grad=False)
    return nn.Parameter(torch.stack(weights), requires_grad=False)
