"""The Llama family (Llama, Mistral, Qwen2, Qwen3) over a flattened, unpadded batch.

The model sees one "super-sequence" per step: token ids ``[T]`` and positions ``[T]`` of every
scheduled request, an attention-metadata object that says where each request's tokens and KV
blocks are, and one paged KV tensor per layer. It returns hidden states ``[T, hidden]``, or only the
rows a step samples from (``FinalRows``: the last layer then computes everything after its K/V for
those rows alone); the runner applies the LM head to the sampled rows (``compute_logits``).

Weights are loaded from Hugging Face tensor names; q/k/v and gate/up are fused into one matmul
each because two larger matmuls are faster than five small ones on CPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from bulkinfer.engine.attention import AttentionBackend, AttentionMetadata
from bulkinfer.engine.models.layers import (
    MLP,
    Embedding,
    FinalRows,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    apply_rope,
)
from bulkinfer.engine.models.llama_config import LlamaFamilyConfig
from bulkinfer.engine.models.module_list import ModuleSeq
from bulkinfer.engine.models.native_decode import NativeDecode
from bulkinfer.engine.models.step_rows import StepRows
from bulkinfer.engine.parallel.plan import Split
from bulkinfer.engine.parallel.plans import llama_plan
from bulkinfer.engine.quant.linear import QuantizedLinear

if TYPE_CHECKING:
    from bulkinfer.engine.cpu_kernels import CpuKernels
    from bulkinfer.engine.gpu_kernels.layer_ops import TritonLayerOps


class Attention(nn.Module):
    kernels: CpuKernels | TritonLayerOps | None = None  # use_cpu_kernels / use_gpu_layer_ops
    step_rows: StepRows  # the model's, shared with its projections: set by LlamaForCausalLM

    def __init__(self, config: LlamaFamilyConfig, layer_index: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.sliding_window = config.sliding_windows[layer_index] if config.sliding_windows else None
        self.backend = backend

    def forward(
        self,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
        kv_cache: torch.Tensor,
        keep: FinalRows | None = None,
    ) -> torch.Tensor:
        """The attention output of every row, or of `keep.rows` only (every row's K/V is written
        to the cache either way)."""
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        cos, sin = rope
        q = self.rotate(q, cos, sin)
        k = self.rotate(k, cos, sin)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        self.backend.write_kv(k, v, k_cache, v_cache, metadata)
        out = self.backend.forward(
            q, k_cache, v_cache, metadata, sliding_window=self.sliding_window, key=k, value=v
        )
        out = out.view(num_tokens, self.q_size)
        if keep is not None:
            out = out.index_select(0, keep.rows)
            # From here on the layer's rows are the kept ones, their single-token rows first.
            self.step_rows.single = keep.num_single
            if self.step_rows.lora is not None:
                self.step_rows.lora = self.step_rows.lora.select(keep.rows)
        return self.o_proj(out)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary embedding of q or k ``[T, heads, head_dim]`` (a family with partial rotary overrides it)."""
        return apply_rope(x, cos, sin, self.kernels)



class DecoderLayer(nn.Module):
    attention_class: type[Attention] = Attention  # a family's own attention (e.g. partial rotary)

    def __init__(self, config: LlamaFamilyConfig, layer_index: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = self.attention_class(config, layer_index, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
        kv_cache: torch.Tensor,
        keep: FinalRows | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output, the residual stream before it): each residual add happens inside
        the norm that follows it (vLLM's layout), so the pair can be one fused op. `keep`: the output
        (and residual) of its rows only."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rope, metadata, kv_cache, keep)
        if keep is not None:
            residual = residual.index_select(0, keep.rows)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    """Llama / Mistral / Qwen2 / Qwen3 decoder over a flattened batch with a paged KV cache."""

    decoder_layer_class: type[nn.Module] = DecoderLayer  # a family's own layer (Gemma 3, Phi-3)
    final_logit_softcap: float | None = None  # logits = cap * tanh(logits / cap) where set (Gemma)
    _logits_buffer: torch.Tensor | None = None  # compute_logits' output on CPU, kept between steps
    config_class = LlamaFamilyConfig  # parses config.json for this class (the loader calls from_hf_dict)
    tensor_parallel_size = 1  # the ranks one model is split over (engine/parallel/loading.py sets it)

    def __init__(self, config: LlamaFamilyConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers: ModuleSeq[DecoderLayer] = ModuleSeq(
            self.decoder_layer_class(config, i, backend) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        self.step_rows = StepRows()
        for layer in self.layers:
            layer.self_attn.step_rows = self.step_rows
        self.native_decode: NativeDecode | None = None  # set by use_cpu_kernels where it applies
        self.cpu_kernels: CpuKernels | None = None  # likewise (None: PyTorch everywhere)
        self.requires_grad_(False)

    @classmethod
    def parse_config(cls, architecture: str, cfg: dict[str, Any]) -> LlamaFamilyConfig:
        """This class's config from an HF ``config.json`` dict (a family with more fields overrides it,
        or names its ``config_class``)."""
        return cls.config_class.from_hf_dict(architecture, cfg)

    def fits_native_decode(self) -> bool:
        """Whether the layers are the plain Llama layout decode_layers.c runs (full rotary, the
        head_dim ** -0.5 scale, two norms, SiLU MLP); a family that differs overrides it."""
        return True

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        kv_caches: list[torch.Tensor],
        num_layers: int | None = None,
        final_rows: FinalRows | None = None,
    ) -> torch.Tensor:
        """`num_layers`: run only the first that many decoder layers (start-up profiling: every
        layer's activations are the same size, so the first few show the peak). `final_rows`: return
        those rows' hidden states only ([len(rows), hidden], ascending), computing the last layer's
        output for them alone."""
        self.step_rows.single = metadata.num_decodes
        lora = self.step_rows.lora
        # A step with adapter rows runs here where decode_layers.c has the adapters' slots.
        images = self.step_rows.images
        if self.native_decode is not None and metadata.num_prefills == 0 and not metadata.fixed_shape \
                and (lora is None or self.native_decode.has_lora) and images is None \
                and self.step_rows.rope_rows is None:
            layers_out = self.native_decode.run(input_ids, positions, metadata, kv_caches,
                                                lora.slots if lora is not None else None)
            if layers_out is not None:
                hidden = self.norm(*layers_out)[0]
                return hidden if final_rows is None else hidden.index_select(0, final_rows.rows)
        hidden = self.embed_tokens(input_ids)
        if images is not None:
            hidden.index_copy_(0, images.flat_index, images.embeds.to(hidden.dtype))
        rope = self.step_rope(self.rotary(positions, hidden.dtype), hidden.dtype)
        residual = None
        layers = self.layers if num_layers is None else self.layers[:num_layers]
        last = len(layers) - 1
        for index, (layer, kv_cache) in enumerate(zip(layers, kv_caches, strict=True)):
            keep = final_rows if index == last else None
            hidden, residual = layer(hidden, residual, rope, metadata, kv_cache, keep)
        return self.norm(hidden, residual)[0]

    def step_rope(self, rope: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor,
                                                                                            torch.Tensor]:
        """The step's cos/sin: a family with positions of its own (M-RoPE) changes some rows."""
        return rope

    @staticmethod
    def normalize_tensor_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A family whose checkpoints name tensors two ways reads both (Qwen2.5-VL)."""
        return tensors

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits (what sampling, penalties, grammar masks and logprobs work on), in every
        compute dtype: the LM head's fp32 sums, never rounded to bf16 on the way. On CPU they are
        written into one buffer kept for the next call (a step's logits are used up within the
        step): 256 rows of a 49k vocabulary are 50 MB, which a fresh tensor would map and fault in
        page by page every step (2x the head's time at 256 rows)."""
        rows = hidden.shape[0] if hidden.dim() == 2 else 0
        out = None
        if rows and hidden.device.type == "cpu":
            if self._logits_buffer is None or self._logits_buffer.shape[0] < rows:
                self._logits_buffer = torch.empty(rows, self.config.vocab_size, dtype=torch.float32)
            out = self._logits_buffer[:rows]
        return self.lm_head.forward_fp32(hidden, out=out)

    def use_cpu_kernels(self, kernels: CpuKernels | None) -> None:
        """Run norms, rotary, the MLP activation and single-token rows' projections through the
        native kernels (on CPU, in the dtypes each supports; the rest keeps PyTorch); None: PyTorch
        everywhere (projections unpacked by the row kernel fall back to ``F.linear``)."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, MLP)):
                module.kernels = kernels
            if isinstance(module, Linear):
                # The LM head's rows are the sampled positions: every one a row of its own.
                module.use_row_gemm(kernels, None if module is self.lm_head else self.step_rows)
            if isinstance(module, QuantizedLinear):
                module.use_kernels(kernels, self.step_rows)
        self.cpu_kernels = kernels
        self.native_decode = NativeDecode.for_model(self, kernels)

    def use_gpu_layer_ops(self, ops: TritonLayerOps | None) -> None:
        """Run norms (with their residual add), rotary and the MLP activation through Triton
        (engine/gpu_kernels/layer_ops.py) where its ``layer_ops_apply`` says so (CUDA tensors); None:
        PyTorch for them. Only those modules' ``kernels`` change (replacing what use_cpu_kernels set
        there): projections, the native decode path and LoRA keep theirs, as they call CpuKernels'
        other methods. The ops compute each row alone, so batch invariance needs no fixed row blocks
        for them and holds with them on (use_batch_invariance composes in either order)."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, MLP)):
                module.kernels = ops

    def use_batch_invariance(self, on: bool) -> None:
        """Batch invariance (engine/config.py ``batch_invariant``): every projection row through the row
        kernel where it runs, and where no native kernel runs an op (the kernels off, a GPU) its
        rows in fixed blocks (engine/invariant/). Attention's part is the backend's own setting."""
        self.step_rows.every_row = on
        for module in self.modules():
            if hasattr(type(module), "fixed_row_blocks"):
                setattr(module, "fixed_row_blocks", on)  # noqa: B010 - any module's own flag
        for layer in self.layers:
            for module in layer.modules():
                if isinstance(module, Linear):
                    module.blocks_by_step = self.step_rows if on else None

    def pack_linear_weights(self, batch_hint: int = 64) -> None:
        """Switch every projection to oneDNN with packed weights (call after loading weights)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack_for_onednn(batch_hint)

    def tensor_parallel_plan(self) -> dict[str, Split]:
        """How each checkpoint tensor splits over tensor-parallel ranks (engine/parallel/plan.py)."""
        return llama_plan(self.config)

    def projection_sources(self) -> dict[str, tuple[str, ...]]:
        """Each projection module (our path) and the checkpoint's linear layers it concatenates, in
        order: what a quantized checkpoint's layers become (engine/models/loader.py)."""
        sources: dict[str, tuple[str, ...]] = {"lm_head": ("lm_head",)}
        for i, layer in enumerate(self.layers):
            ours, hf = f"layers.{i}.", f"model.layers.{i}."
            qkv = tuple(f"{hf}self_attn.{n}_proj" for n in self.qkv_sources())
            sources[ours + "self_attn.qkv_proj"] = qkv
            sources[ours + "self_attn.o_proj"] = (hf + "self_attn.o_proj",)
            if isinstance(layer.mlp, MLP):
                gate_up = tuple(f"{hf}mlp.{n}_proj" for n in self.gate_up_sources())
                sources[ours + "mlp.gate_up_proj"] = gate_up
                sources[ours + "mlp.down_proj"] = (hf + "mlp.down_proj",)
        return sources

    def qkv_sources(self) -> tuple[str, ...]:
        """The checkpoint's attention input projections (x in "self_attn.x_proj"), fused in this order."""
        return ("q", "k", "v")

    def gate_up_sources(self) -> tuple[str, ...]:
        return ("gate", "up")

    # ---- loading from Hugging Face tensor names -------------------------------------------------

    def tie_weights(self) -> None:
        """The LM head shares the embedding's weight where the checkpoint ties them; called again
        after moving the model off the meta device (``to_empty`` gives each its own tensor)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def expected_hf_tensors(self) -> dict[str, tuple[int, ...]]:
        """HF tensor name -> shape, for every tensor a checkpoint of this config must contain."""
        c = self.config
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        shapes: dict[str, tuple[int, ...]] = {
            "model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
            "model.norm.weight": (c.hidden_size,),
        }
        if not c.tie_word_embeddings:
            shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            shapes[p + "input_layernorm.weight"] = (c.hidden_size,)
            shapes[p + "post_attention_layernorm.weight"] = (c.hidden_size,)
            for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                shapes[f"{p}self_attn.{name}.weight"] = (rows, c.hidden_size)
                if c.qkv_bias:
                    shapes[f"{p}self_attn.{name}.bias"] = (rows,)
            shapes[p + "self_attn.o_proj.weight"] = (c.hidden_size, q)
            if c.o_bias:
                shapes[p + "self_attn.o_proj.bias"] = (c.hidden_size,)
            if c.qk_norm:
                shapes[p + "self_attn.q_norm.weight"] = (c.head_dim,)
                shapes[p + "self_attn.k_norm.weight"] = (c.head_dim,)
            for name, out_dim, in_dim in (
                ("gate_proj", c.intermediate_size, c.hidden_size),
                ("up_proj", c.intermediate_size, c.hidden_size),
                ("down_proj", c.hidden_size, c.intermediate_size),
            ):
                shapes[f"{p}mlp.{name}.weight"] = (out_dim, in_dim)
                if c.mlp_bias:
                    shapes[f"{p}mlp.{name}.bias"] = (out_dim,)
        return shapes

    @torch.no_grad()
    def load_hf_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy already-validated HF tensors (see ``expected_hf_tensors``) into the fused modules."""
        c = self.config
        self.embed_tokens.weight.copy_(tensors["model.embed_tokens.weight"])
        self.norm.weight.copy_(tensors["model.norm.weight"])
        if not c.tie_word_embeddings:
            self.lm_head.weight.copy_(tensors["lm_head.weight"])
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            layer.input_layernorm.weight.copy_(tensors[p + "input_layernorm.weight"])
            layer.post_attention_layernorm.weight.copy_(tensors[p + "post_attention_layernorm.weight"])
            qkv = [f"{p}self_attn.{n}_proj" for n in ("q", "k", "v")]
            attn.qkv_proj.weight.copy_(torch.cat([tensors[n + ".weight"] for n in qkv]))
            if c.qkv_bias:
                attn.qkv_proj.bias.copy_(torch.cat([tensors[n + ".bias"] for n in qkv]))
            attn.o_proj.weight.copy_(tensors[p + "self_attn.o_proj.weight"])
            if c.o_bias:
                attn.o_proj.bias.copy_(tensors[p + "self_attn.o_proj.bias"])
            if c.qk_norm:
                assert attn.q_norm is not None and attn.k_norm is not None
                attn.q_norm.weight.copy_(tensors[p + "self_attn.q_norm.weight"])
                attn.k_norm.weight.copy_(tensors[p + "self_attn.k_norm.weight"])
            if not isinstance(mlp, MLP):
                continue  # another family's MLP (a sparse MoE block) loads its own tensors
            gate_up = [f"{p}mlp.{n}_proj" for n in ("gate", "up")]
            mlp.gate_up_proj.weight.copy_(torch.cat([tensors[n + ".weight"] for n in gate_up]))
            mlp.down_proj.weight.copy_(tensors[p + "mlp.down_proj.weight"])
            if c.mlp_bias:
                mlp.gate_up_proj.bias.copy_(torch.cat([tensors[n + ".bias"] for n in gate_up]))
                mlp.down_proj.bias.copy_(tensors[p + "mlp.down_proj.bias"])
