"""Pure decode steps through one native call for all decoder layers (engine/cpu_kernels/decode_layers.c).

A decode step drives a dozen kernels per layer; from Python that is 5-8 ms of interpreter and ctypes
work per step on a 30-layer model, a fifth of a small batch's step. Where the model fits the native
path (CPU, the Llama layout without sliding windows, every projection on the row
kernel or a quantized checkpoint's kernels, the native decode kernel, and the prefix kernel when the
step has shared-prefix groups),
the layers run from C with the same kernels in the same order, so the outputs are the bits the
Python path gives (tested); everything else keeps the Python path.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from bulkinfer.engine.attention import AttentionBackend, AttentionMetadata, TorchPagedAttention
from bulkinfer.engine.models.layers import MLP, Linear, RMSNorm, RotaryEmbedding
from bulkinfer.engine.models.llama_config import LlamaFamilyConfig
from bulkinfer.engine.models.sparse_moe import SparseMoeBlock
from bulkinfer.engine.quant.linear import QuantizedLinear

if TYPE_CHECKING:
    from bulkinfer.engine.cpu_kernels import CpuKernels
    from bulkinfer.engine.lora.slots import LoRASlots


class DecodeAttention(Protocol):
    """What the native path reads of a layer's attention (engine/models/llama.py's Attention)."""

    @property
    def qkv_proj(self) -> Linear: ...
    @property
    def o_proj(self) -> Linear: ...
    @property
    def q_norm(self) -> RMSNorm | None: ...
    @property
    def k_norm(self) -> RMSNorm | None: ...
    @property
    def backend(self) -> AttentionBackend: ...


class DecodeLayer(Protocol):
    """What the native path reads of a decoder layer."""

    @property
    def input_layernorm(self) -> RMSNorm: ...
    @property
    def post_attention_layernorm(self) -> RMSNorm: ...
    @property
    def self_attn(self) -> DecodeAttention: ...
    @property
    def mlp(self) -> MLP | SparseMoeBlock: ...


class DecodeModel(Protocol):
    """The model the native path runs: the Llama layout's modules (LlamaForCausalLM and the families
    built on it), read here without importing them (they build this path in use_cpu_kernels)."""

    @property
    def config(self) -> LlamaFamilyConfig: ...
    @property
    def embed_tokens(self) -> nn.Embedding: ...
    @property
    def layers(self) -> Iterable[DecodeLayer]: ...
    @property
    def rotary(self) -> RotaryEmbedding: ...
    def fits_native_decode(self) -> bool: ...

_P = ctypes.c_void_p
_MOE_BUFFERS = ("router_logits", "pair_expert", "pair_weight", "pair_position", "pair_in", "pair_gate_up",
                "pair_act", "pair_out", "shared_gate_out", "shared_gate_up", "shared_act", "shared_out")


class _Moe(ctypes.Structure):
    _fields_ = [(name, _P) for name in ("router", "gate_up", "down", "shared_gate_up", "shared_down",
                                         "shared_gate")]


class _Lora(ctypes.Structure):
    _fields_ = [("a", _P), ("b", _P), ("widths", _P)]


_LORA_PROJECTIONS = ("qkv", "o", "gate_up", "down")


class _Quant(ctypes.Structure):
    """decode_layers.c's decode_quant: a quantized projection (QuantizedLinear.native_fields)."""

    _fields_ = [("kind", ctypes.c_int64), ("weight", _P), ("row_bytes", ctypes.c_int64),
                ("bits", ctypes.c_int64), ("group", ctypes.c_int64), ("scales", _P), ("zeros", _P),
                ("col_sums", _P), ("bias", _P),
                ("act_mode", ctypes.c_int64), ("act_scale", ctypes.c_float), ("act_zero", ctypes.c_int64)]


class _Layer(ctypes.Structure):
    _fields_ = [*[(name, _P) for name in (
        "input_norm", "post_norm", "qkv", "qkv_bias", "o", "o_bias", "gate_up", "gate_up_bias", "down",
        "down_bias", "k_cache", "v_cache", "q_norm", "k_norm")], ("moe", ctypes.POINTER(_Moe)),
        *[(f"{name}_lora", ctypes.POINTER(_Lora)) for name in _LORA_PROJECTIONS],
        *[(f"{name}_quant", ctypes.POINTER(_Quant)) for name in _LORA_PROJECTIONS]]


_QUANT_BUFFERS = ("quant_in", "quant_out", "quant_u8", "quant_x16", "quant_row_scales", "quant_row_zeros",
                  "quant_raw")


class _Step(ctypes.Structure):
    _fields_ = [
        *[(name, ctypes.c_int64) for name in ("layers", "rows", "hidden_size", "heads", "kv_heads",
                                               "head_dim", "intermediate", "block_size", "bf16")],
        ("eps", ctypes.c_float), ("scale", ctypes.c_float),
        ("cos", _P), ("sin", _P), ("write_rows", _P), ("tables", _P), ("table_stride", ctypes.c_int64),
        ("tokens", _P), ("first", _P),
        ("prefix_batches", ctypes.c_int64), ("prefix_info", _P), ("prefix_rows", _P), ("prefix_blocks", _P),
        ("prefix_scratch", _P), ("group_q", _P), ("group_out", _P), ("group_lse", _P),
        *[(name, _P) for name in ("residual", "hidden", "normed", "qkv_out", "q", "attn", "init_out",
                                  "init_lse", "lse", "gate_up_out", "act")],
        ("threads", ctypes.c_int64),
        *[(name, ctypes.c_int64) for name in ("experts", "top_k", "expert_intermediate",
                                               "shared_intermediate", "normalize_top_k", "round_weights")],
        *[(name, _P) for name in _MOE_BUFFERS],
        ("moe_seconds", _P),
        ("lora_slots", _P),
        *[(name, _P) for name in _QUANT_BUFFERS],
    ]


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return tensor.data_ptr() if tensor is not None else None


class NativeDecode:
    """The native decode path of one model: built once (``for_model``), run per pure decode step."""

    def __init__(self, model: DecodeModel, kernels: CpuKernels, backend: TorchPagedAttention) -> None:
        self.model, self.kernels, self.backend = model, kernels, backend
        config = model.config
        self.dtype = model.embed_tokens.weight.dtype
        self.layers = (_Layer * config.num_layers)()
        # Keep what the table points to alive with the model (the packed weights already are; the
        # sparse layers' and the LoRA slots' tables are kept here).
        self._tables: list[ctypes.Structure | ctypes.Array] = []
        self.sparse: SparseMoeBlock | None = None  # a sparse layer's block, for the step's MoE shapes
        # float64 [2]: where set, each step adds its sparse layers' routing and expert seconds to it
        # (benchmarks/moe_profile.py).
        self.moe_seconds: torch.Tensor | None = None
        self.has_lora = False  # attach_lora: steps with adapter rows take this path too
        self.quantized: list[QuantizedLinear] = []  # a quantized checkpoint's projections
        for entry, layer in zip(self.layers, model.layers, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            entry.input_norm = layer.input_layernorm.weight.data_ptr()
            entry.post_norm = layer.post_attention_layernorm.weight.data_ptr()
            for name, linear in (("qkv", attn.qkv_proj), ("o", attn.o_proj)):
                self._point_at(entry, name, linear)
            if attn.q_norm is not None and attn.k_norm is not None:
                entry.q_norm, entry.k_norm = attn.q_norm.weight.data_ptr(), attn.k_norm.weight.data_ptr()
            if isinstance(mlp, SparseMoeBlock):  # (for_model checked each MLP's exact type)
                entry.moe = ctypes.pointer(self._moe_table(mlp))
                self.sparse = mlp
                continue
            for name, linear in (("gate_up", mlp.gate_up_proj), ("down", mlp.down_proj)):
                self._point_at(entry, name, linear)

    def _point_at(self, entry: _Layer, name: str, linear: Linear) -> None:
        """The layer's entry for one projection: the row kernel's packed weights and bias, or a
        quantized projection's table."""
        if isinstance(linear, QuantizedLinear):
            fields = linear.native_fields()
            assert fields is not None
            table = _Quant(**fields)
            self._tables.append(table)
            self.quantized.append(linear)
            setattr(entry, f"{name}_quant", ctypes.pointer(table))
            return
        setattr(entry, name, _row_weight(linear))
        setattr(entry, f"{name}_bias", _pointer(linear.bias))

    def attach_lora(self, slots: dict[str, LoRASlots]) -> bool:
        """Point each projection at its LoRA slots (engine/lora/slots.py; by module path, e.g.
        "layers.3.self_attn.qkv_proj"), so steps with adapter rows run here too; False (and steps
        with adapter rows keep the Python path) where the slots do not run on the native kernel."""
        if any(s.kernels is not self.kernels for s in slots.values()):
            return False
        paths = {"qkv": "self_attn.qkv_proj", "o": "self_attn.o_proj", "gate_up": "mlp.gate_up_proj",
                 "down": "mlp.down_proj"}
        for index, entry in enumerate(self.layers):
            for name in _LORA_PROJECTIONS:
                found = slots.get(f"layers.{index}.{paths[name]}")
                if found is None:
                    continue
                table = _Lora(a=found.packed_a.data_ptr(), b=found.packed_b.data_ptr(),
                              widths=found.packed_widths.data_ptr())
                self._tables.append(table)
                setattr(entry, f"{name}_lora", ctypes.pointer(table))
        self.has_lora = True
        return True

    def _moe_table(self, block: SparseMoeBlock) -> _Moe:
        """decode_layers.c's table of a sparse block's packed weights."""
        gate_up = (_P * len(block.experts))(*[_row_weight(e.gate_up_proj) for e in block.experts])
        down = (_P * len(block.experts))(*[_row_weight(e.down_proj) for e in block.experts])
        table = _Moe(router=_row_weight(block.gate), gate_up=ctypes.addressof(gate_up),
                     down=ctypes.addressof(down))
        if block.shared_expert is not None and block.shared_expert_gate is not None:
            table.shared_gate_up = _row_weight(block.shared_expert.gate_up_proj)
            table.shared_down = _row_weight(block.shared_expert.down_proj)
            table.shared_gate = _row_weight(block.shared_expert_gate)
        self._tables += [gate_up, down, table]
        return table

    @staticmethod
    def for_model(model: DecodeModel, kernels: CpuKernels | None) -> NativeDecode | None:
        """The native path where this model fits it on this machine, else None."""
        config = model.config
        if kernels is None or not model.fits_native_decode():
            return None
        if getattr(model, "tensor_parallel_size", 1) > 1:
            # The layers run from C, which cannot all-reduce between them: a tensor-parallel rank
            # steps through the Python path (its norms, attention and projections still native).
            return None
        if any(window is not None for window in config.sliding_windows):
            return None
        backend = next(iter(model.layers)).self_attn.backend
        weight = model.embed_tokens.weight
        if not isinstance(backend, TorchPagedAttention) or backend.kernels is not kernels:
            return None
        if weight.device.type != "cpu" or not kernels.layer_ops_apply(weight):
            return None
        if not kernels.supports(weight.dtype, config.head_dim, 16) or config.num_heads % config.num_kv_heads:
            return None
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if type(mlp) not in (MLP, SparseMoeBlock):  # not a subclass: another family's MLP
                return None
            if config.qk_norm and not (type(attn.q_norm) is RMSNorm and type(attn.k_norm) is RMSNorm):
                return None  # decode_layers.c applies the Llama RMSNorm per head (Qwen3's q/k norm)
            linears = [attn.qkv_proj, attn.o_proj, *_mlp_linears(mlp)]
            if not all(map(_runs_natively, linears)) or attn.backend is not backend:
                return None
        return NativeDecode(model, kernels, backend)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
            kv_caches: list[torch.Tensor],
            lora_slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(the last layer's output, the residual stream) of a pure decode step, or None where this
        step needs the Python path (another cache layout, or shared-prefix groups without the
        prefix kernel)."""
        model, config, backend = self.model, self.model.config, self.backend
        k_cache = kv_caches[0][0]
        block_size = k_cache.shape[-2]
        if metadata.num_prefills or block_size != metadata.block_size or not backend._uses_kernel(k_cache):
            return None
        rows = int(input_ids.shape[0])
        if not all(linear.native_rows_match(rows, self.dtype) for linear in self.quantized):
            return None  # the Python path takes these rows through a dequantized GEMM
        group = config.num_heads // config.num_kv_heads
        plan, _ = backend.plan_for_decode(metadata, None, k_cache, self.dtype, group)
        if plan.prefix_batches and not self._attends_groups(k_cache):
            return None
        hidden_size, head_dim = config.hidden_size, config.head_dim
        q_size, kv_size = config.num_heads * head_dim, config.num_kv_heads * head_dim
        residual = model.embed_tokens(input_ids)
        cos, sin = model.rotary(positions, self.dtype)
        cos, sin = (part.reshape(rows, head_dim // 2).contiguous() for part in (cos, sin))
        write_rows = backend.write_rows(metadata, config.num_kv_heads)
        assert plan.own_tables is not None and plan.own_tokens is not None and plan.own_first is not None
        tables = plan.own_tables.contiguous()
        tokens, first = plan.own_tokens.contiguous(), plan.own_first.contiguous()

        def buffer(*shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
            return torch.empty(*shape, dtype=dtype or self.dtype)

        step = _Step(layers=config.num_layers, rows=rows, hidden_size=hidden_size, heads=config.num_heads,
                     kv_heads=config.num_kv_heads, head_dim=head_dim, intermediate=config.intermediate_size,
                     block_size=block_size, bf16=int(self.dtype == torch.bfloat16), eps=config.rms_norm_eps,
                     scale=head_dim ** -0.5, cos=cos.data_ptr(), sin=sin.data_ptr(),
                     write_rows=write_rows.data_ptr(), tables=tables.data_ptr(),
                     table_stride=tables.stride(0),
                     tokens=tokens.data_ptr(), first=first.data_ptr(), threads=torch.get_num_threads())
        keep = [cos, sin, tables, tokens, first]  # alive until the call returns
        if lora_slots is not None:
            assert self.has_lora and lora_slots.dtype == torch.int64 and lora_slots.shape == (rows,)
            lora_slots = lora_slots.contiguous()
            step.lora_slots = lora_slots.data_ptr()
            keep.append(lora_slots)
        if plan.prefix_batches:
            keep += self._prefix_batches(step, plan.prefix_batches, config.num_kv_heads, head_dim, block_size,
                                         rows)
        hidden = buffer(rows, hidden_size)
        buffers = {"residual": residual, "hidden": hidden, "normed": buffer(rows, hidden_size),
                   "qkv_out": buffer(rows, q_size + 2 * kv_size), "q": buffer(rows, q_size),
                   "attn": buffer(rows, q_size), "lse": buffer(rows, config.num_heads, dtype=torch.float32),
                   "gate_up_out": buffer(rows, 2 * config.intermediate_size),
                   "act": buffer(rows, config.intermediate_size)}
        if self.quantized:
            buffers.update(self._quant_buffers(rows))
        if self.sparse is not None:
            buffers.update(self._moe_buffers(step, rows))
            if self.moe_seconds is not None:
                assert self.moe_seconds.dtype == torch.float64 and self.moe_seconds.shape == (2,)
                step.moe_seconds = self.moe_seconds.data_ptr()
        for name, tensor in buffers.items():
            setattr(step, name, tensor.data_ptr())
        for entry, cache in zip(self.layers, kv_caches, strict=True):
            entry.k_cache, entry.v_cache = cache[0].data_ptr(), cache[1].data_ptr()
        self.kernels.decode_layers(self.layers, step)
        del keep
        return hidden, residual

    def _quant_buffers(self, rows: int) -> dict[str, torch.Tensor]:
        """decode_layers.c's scratch for the quantized projections, by field name."""
        sizes = [linear.native_scratch() for linear in self.quantized]
        inputs, outputs = (max(size[i] for size in sizes) for i in range(2))
        widest = max(inputs, outputs)
        return {"quant_in": torch.empty(rows, widest), "quant_out": torch.empty(rows, widest),
                "quant_u8": torch.empty(rows, inputs, dtype=torch.uint8),
                "quant_x16": torch.empty(rows, inputs, dtype=torch.int16),
                "quant_row_scales": torch.empty(rows),
                "quant_row_zeros": torch.empty(rows, dtype=torch.int32),
                "quant_raw": torch.empty(rows, outputs)}

    def _moe_buffers(self, step: _Step, rows: int) -> dict[str, torch.Tensor]:
        """Fill the step's sparse-layer shapes; returns its sparse-layer buffers by field name."""
        block, config = self.sparse, self.model.config
        assert block is not None
        experts, top_k, hidden = block.num_experts, block.top_k, config.hidden_size
        width = block.experts[0].intermediate_size
        shared = block.shared_expert.intermediate_size if block.shared_expert is not None else 0
        step.experts, step.top_k = experts, top_k
        step.expert_intermediate, step.shared_intermediate = width, shared
        step.normalize_top_k = int(block.norm_topk_prob)
        # Qwen multiplies by weights rounded to the model dtype (a no-op in fp32); Mixtral by fp32 ones.
        step.round_weights = int(self.dtype == torch.bfloat16 and not block.routing_weights_in_fp32)
        pairs = rows * top_k

        def buffer(*shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
            return torch.empty(*shape, dtype=dtype or self.dtype)

        return {"router_logits": buffer(rows, experts), "pair_expert": buffer(pairs, dtype=torch.int64),
                "pair_weight": buffer(pairs, dtype=torch.float32),
                "pair_position": buffer(pairs, dtype=torch.int64), "pair_in": buffer(pairs, hidden),
                "pair_gate_up": buffer(pairs, 2 * width), "pair_act": buffer(pairs, width),
                "pair_out": buffer(pairs, hidden), "shared_gate_out": buffer(rows, 1),
                "shared_gate_up": buffer(rows, 2 * max(shared, 1)),
                "shared_act": buffer(rows, max(shared, 1)), "shared_out": buffer(rows, hidden)}

    def _attends_groups(self, k_cache: torch.Tensor) -> bool:
        """Whether decode_layers.c can attend this step's shared-prefix groups: in bf16 with the
        prefix kernel (the attention backend's rule for it), in fp32 with the causal kernel."""
        if self.dtype == torch.bfloat16:
            return (self.backend._uses_prefix_kernel(self.dtype, k_cache)
                    and self.kernels.has_prefix_decode_layers)
        return self.dtype == torch.float32 and self.backend._uses_causal_kernel(self.dtype, k_cache)

    def _prefix_batches(self, step: _Step, batches: list, kv_heads: int, head_dim: int, block_size: int,
                        rows: int) -> list[torch.Tensor]:
        """Fill the step's shared-prefix fields; returns the tensors they point into."""
        config = self.model.config
        info, row_lists, block_lists, row_at, block_at, scratch, most_rows = [], [], [], 0, 0, 0, 0
        for batch in batches:
            groups, shared = batch.block_ids.shape
            info += [groups, batch.rows.numel() // groups, shared, row_at, block_at]
            row_lists.append(batch.rows.reshape(-1))
            block_lists.append(batch.block_ids.reshape(-1))
            row_at += batch.rows.numel()
            block_at += batch.block_ids.numel()
            most_rows = max(most_rows, batch.rows.numel() // groups)
            length = shared * block_size
            if self.dtype == torch.bfloat16:  # the prefix kernel packs every group's K and V at once
                scratch = max(scratch, groups * kv_heads * (length + -(-length // 32) * 32) * head_dim)
            else:  # the causal kernel packs one group's K, VL keys at a time in blocks of 4 VL
                step_keys = 4 * self.kernels.vector_lanes
                scratch = max(scratch, kv_heads * -(-length // step_keys) * step_keys * head_dim)
        info_t = torch.tensor(info, dtype=torch.int64)
        rows_t = torch.cat(row_lists).to(torch.int64).contiguous()
        blocks_t = torch.cat(block_lists).to(torch.int64).contiguous()
        name = "prefix" if self.dtype == torch.bfloat16 else "causal"
        packed = self.kernels._scratch_buffer(name, scratch, self.dtype)
        init_out = torch.empty(rows, config.num_heads * head_dim, dtype=self.dtype)
        init_lse = torch.empty(rows, config.num_heads, dtype=torch.float32)
        step.prefix_batches = len(batches)
        step.prefix_info, step.prefix_rows = info_t.data_ptr(), rows_t.data_ptr()
        step.prefix_blocks, step.prefix_scratch = blocks_t.data_ptr(), packed.data_ptr()
        step.init_out, step.init_lse = init_out.data_ptr(), init_lse.data_ptr()
        keep = [info_t, rows_t, blocks_t, packed, init_out, init_lse]
        if self.dtype == torch.float32:
            group_q = torch.empty(most_rows, config.num_heads * head_dim)
            group_out, group_lse = torch.empty_like(group_q), torch.empty(most_rows, config.num_heads)
            step.group_q, step.group_out = group_q.data_ptr(), group_out.data_ptr()
            step.group_lse = group_lse.data_ptr()
            keep += [group_q, group_out, group_lse]
        return keep


def _runs_natively(linear: torch.nn.Module) -> bool:
    """A projection decode_layers.c can run: on the row kernel, or a quantized one with its tables."""
    if isinstance(linear, QuantizedLinear):
        return linear.native_fields() is not None
    return linear.row_weight is not None


def _row_weight(linear: Linear) -> int:
    """Where a projection's row-kernel weights are (packed by use_row_gemm before this table)."""
    assert linear.row_weight is not None, "the row kernel's weights are packed first"
    return linear.row_weight.data_ptr()


def _mlp_linears(mlp: MLP | SparseMoeBlock) -> list:
    """Every projection a layer's MLP runs: a dense MLP's two, or a sparse block's router, experts and
    shared expert (with its gate)."""
    if not isinstance(mlp, SparseMoeBlock):
        return [mlp.gate_up_proj, mlp.down_proj]
    experts = [p for e in mlp.experts for p in (e.gate_up_proj, e.down_proj)]
    linears: list[Linear | None] = [mlp.gate, *experts]
    if mlp.shared_expert is not None:
        linears += [mlp.shared_expert.gate_up_proj, mlp.shared_expert.down_proj, mlp.shared_expert_gate]
    return linears
