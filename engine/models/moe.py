"""Mixture-of-experts decoders: Qwen3-MoE, Qwen2-MoE (shared expert) and Mixtral.

The attention half of each layer is the Llama family's; the MLP of a sparse layer is the sparse block
(engine/models/sparse_moe.py: a router over ``num_experts`` expert MLPs, and Qwen2-MoE's shared
expert). Dense layers among sparse ones (``mlp_only_layers``, ``decoder_sparse_step``) keep the
ordinary MLP.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from bulkinfer.engine.attention import AttentionBackend, AttentionMetadata
from bulkinfer.engine.models.layers import MLP, FinalRows
from bulkinfer.engine.models.llama import LlamaForCausalLM
from bulkinfer.engine.models.sparse_moe import QWEN_NAMES, MoeConfig, SparseMoeBlock, StepShape
from bulkinfer.engine.parallel.plan import Split
from bulkinfer.engine.parallel.plans import moe_plan

if TYPE_CHECKING:
    from bulkinfer.engine.gpu_kernels.layer_ops import TritonLayerOps


class MoeForCausalLM(LlamaForCausalLM):
    """Qwen3-MoE / Qwen2-MoE / Mixtral: the Llama-family decoder with sparse MLP layers."""

    config: MoeConfig
    config_class = MoeConfig

    def __init__(self, config: MoeConfig, backend: AttentionBackend) -> None:
        super().__init__(config, backend)
        self.step_shape = StepShape()
        for layer, sparse in zip(self.layers, config.sparse_layers, strict=True):
            if sparse:
                layer.mlp = SparseMoeBlock(config, self.step_rows, self.step_shape)  # type: ignore[assignment]
        self.requires_grad_(False)

    @property
    def graph_capturable(self) -> bool:
        """Whether a fixed-shape decode step records as a CUDA graph: every sparse block's grouped_mm
        keeps its offsets on the device (bf16 on a Hopper-class GPU; engine/decode_graphs.py keeps
        the decode steps of a model where it does not eager on a GPU)."""
        return all(block.fixed_shape_records() and block.grouped_mm_allowed for block in self.sparse_blocks())

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                kv_caches: list[torch.Tensor], num_layers: int | None = None,
                final_rows: FinalRows | None = None) -> torch.Tensor:
        self.step_shape.fixed = metadata.fixed_shape
        return super().forward(input_ids, positions, metadata, kv_caches, num_layers, final_rows)

    def tensor_parallel_plan(self) -> dict[str, Split]:
        """Each expert split by its intermediate channels, the router replicated, one all-reduce
        after the sparse block (engine/parallel/plans.py)."""
        return moe_plan(self.config)

    def sparse_blocks(self) -> list[SparseMoeBlock]:
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, SparseMoeBlock)]

    def use_batch_invariance(self, on: bool) -> None:
        super().use_batch_invariance(on)
        for block in self.sparse_blocks():  # an expert's rows come routed, not in the step's order
            for expert in block.experts:
                expert.gate_up_proj.blocks_by_step = expert.down_proj.blocks_by_step = None

    def use_gpu_layer_ops(self, ops: TritonLayerOps | None) -> None:
        super().use_gpu_layer_ops(ops)
        for block in self.sparse_blocks():  # routing and the shared expert's gated add (the experts are MLPs)
            block.kernels = ops

    def use_cpu_kernels(self, kernels: Any) -> None:
        super().use_cpu_kernels(kernels)
        for block in self.sparse_blocks():
            block.kernels = kernels
            for expert in block.experts:
                for linear in (expert.gate_up_proj, expert.down_proj):
                    if linear.row_weight is not None:
                        linear.step_rows = block.expert_rows

    # ---- loading from Hugging Face tensor names -------------------------------------------------

    def _sparse_tensors(self, index: int) -> dict[str, tuple[int, ...]]:
        c = self.config
        block, (gate, up, down) = c.tensor_names
        p = f"model.layers.{index}.{block}."
        width, hidden = c.moe_intermediate_size, c.hidden_size
        shapes: dict[str, tuple[int, ...]] = {p + "gate.weight": (c.num_experts, hidden)}
        for e in range(c.num_experts):
            shapes[f"{p}experts.{e}.{gate}.weight"] = (width, hidden)
            shapes[f"{p}experts.{e}.{up}.weight"] = (width, hidden)
            shapes[f"{p}experts.{e}.{down}.weight"] = (hidden, width)
        if c.shared_expert_intermediate_size:
            shared = c.shared_expert_intermediate_size
            shapes[p + "shared_expert.gate_proj.weight"] = (shared, hidden)
            shapes[p + "shared_expert.up_proj.weight"] = (shared, hidden)
            shapes[p + "shared_expert.down_proj.weight"] = (hidden, shared)
            shapes[p + "shared_expert_gate.weight"] = (1, hidden)
        return shapes

    def expected_hf_tensors(self) -> dict[str, tuple[int, ...]]:
        shapes = super().expected_hf_tensors()
        for index, sparse in enumerate(self.config.sparse_layers):
            if sparse:
                dense_mlp = f"model.layers.{index}.mlp."
                shapes = {name: shape for name, shape in shapes.items() if not name.startswith(dense_mlp)}
                shapes.update(self._sparse_tensors(index))
        return shapes

    @torch.no_grad()
    def load_hf_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        super().load_hf_tensors(tensors)  # attention, norms, embeddings and the dense layers' MLPs
        block_name, (gate, up, down) = self.config.tensor_names
        for index, layer in enumerate(self.layers):
            block = layer.mlp
            if not isinstance(block, SparseMoeBlock):
                continue
            p = f"model.layers.{index}.{block_name}."
            block.gate.weight.copy_(tensors[p + "gate.weight"])
            for e, expert in enumerate(block.experts):
                _load_mlp(expert, tensors, f"{p}experts.{e}.", (gate, up, down))
            if block.shared_expert is not None and block.shared_expert_gate is not None:
                _load_mlp(block.shared_expert, tensors, p + "shared_expert.", QWEN_NAMES[1])
                block.shared_expert_gate.weight.copy_(tensors[p + "shared_expert_gate.weight"])


def _load_mlp(mlp: MLP, tensors: dict[str, torch.Tensor], prefix: str, names: tuple[str, str, str]) -> None:
    gate, up, down = names
    mlp.gate_up_proj.weight.copy_(torch.cat([tensors[f"{prefix}{name}.weight"] for name in (gate, up)]))
    mlp.down_proj.weight.copy_(tensors[f"{prefix}{down}.weight"])


__all__ = ["MoeConfig", "MoeForCausalLM", "SparseMoeBlock", "StepShape"]
