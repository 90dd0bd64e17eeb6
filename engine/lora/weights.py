"""Reading an adapter's tensors and laying them out per projection of our model.

Per projection the adapter's A matrices are stacked ([width, in]: the q, k, v ranks one after
another) and its B matrices placed on their output slices ([out, width], zeros elsewhere), already
multiplied by the adapter's scale, so applying it is two matmuls: ``(x @ A.T) @ B.T``.

The weights file is read once into memory: its tensors and the adapter's content digest
(engine/lora/identity.py) come from the same bytes, so a file replaced while it is read cannot give
new weights the old digest.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from bulkinfer.engine.errors import LoRAAdapterError
from bulkinfer.engine.lora.adapter_config import WEIGHTS_FILE, AdapterConfig
from bulkinfer.engine.lora.identity import adapter_digest
from bulkinfer.engine.lora.targets import Target

# PEFT's saved names: base_model.model.<the base model's module path>.lora_A.weight
# A vision-language model's decoder sits under `text_model.` (Idefics3) or `language_model.` (Qwen2.5-VL
# in transformers 5); the published Qwen2.5-VL layout has it at `model.layers`, as text models do.
_TENSOR_NAME = re.compile(
    r"^base_model\.model\.model\.(?:text_model\.|language_model\.)?"
    r"(layers\.\d+\.(?:self_attn|mlp)\.\w+)\.lora_([AB])\.weight$")
_VISION_PARTS = ("vision_model.", "visual.", "connector.", "multi_modal_projector.")
# What a PEFT adapter is saved in; others (float8, integers, complex) are no LoRA the engine runs.
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass
class LoadedAdapter:
    """An adapter in host memory: per projection path, (A [width, in], scaled B [out, width])."""

    name: str
    lora_int_id: int
    path: str
    rank: int
    projections: dict[str, tuple[torch.Tensor, torch.Tensor]]
    digest: str  # of its files' content: its KV blocks' identity (engine/lora/identity.py)

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.projections.values())


def load_adapter(name: str, lora_int_id: int, config: AdapterConfig, targets: dict[str, Target],
                 out_features: dict[str, int], max_rank: int, dtype: torch.dtype) -> LoadedAdapter:
    """Read and check the adapter's tensors against the model's targets; raises LoRAAdapterError."""
    where = f"LoRA adapter {name!r} ({config.path})"
    if config.rank > max_rank:
        raise LoRAAdapterError(f"{where}: rank {config.rank} exceeds max_lora_rank={max_rank}")
    pairs, digest = _read_pairs(config, where)
    if config.target_modules is not None:
        available = {module.rsplit(".", 1)[-1] for module in targets}
        missing = [m for m in config.target_modules if m not in available]
        if missing:
            raise LoRAAdapterError(f"{where}: target module(s) {missing} are not in this model "
                                   f"(it has {sorted(available)})")
    by_projection: dict[str, list[tuple[Target, torch.Tensor, torch.Tensor]]] = {}
    for module, (a, b) in sorted(pairs.items()):
        target = targets.get(module)
        if target is None:
            raise LoRAAdapterError(f"{where}: module {module!r} is not a LoRA target of this model")
        if a.dim() != 2 or b.dim() != 2:  # before any shape[0]: a 0-d tensor has none
            raise LoRAAdapterError(f"{where}: {module} has lora_A {tuple(a.shape)} and lora_B "
                                   f"{tuple(b.shape)}; each must be a matrix")
        rank = a.shape[0]
        if rank > max_rank:
            raise LoRAAdapterError(f"{where}: {module} has rank {rank}, above max_lora_rank={max_rank}")
        if rank != config.rank:  # the scale is alpha / r: another rank would be scaled wrong
            raise LoRAAdapterError(f"{where}: {module} has rank {rank}, but r is {config.rank}")
        if tuple(a.shape) != (rank, target.in_features) or tuple(b.shape) != (target.size, rank):
            raise LoRAAdapterError(
                f"{where}: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; this model "
                f"needs ({rank}, {target.in_features}) and ({target.size}, {rank}) (another base model?)")
        by_projection.setdefault(target.projection, []).append((target, a, b))
    scale = config.scale
    projections = {}
    for projection, parts in by_projection.items():
        a_cat = torch.cat([a.float() for _, a, _ in parts])
        b_cat = torch.zeros(out_features[projection], a_cat.shape[0])
        column = 0
        for target, a, b in parts:
            rows = slice(target.offset, target.offset + target.size)
            b_cat[rows, column : column + a.shape[0]] = b.float() * scale
            column += a.shape[0]
        projections[projection] = (a_cat.to(dtype).contiguous(), b_cat.to(dtype).contiguous())
    return LoadedAdapter(name, lora_int_id, str(config.path), config.rank, projections, digest)


def _read_pairs(config: AdapterConfig, where: str
                ) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], str]:
    """The (A, B) pair of each module, and the adapter's content digest."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        data = (config.path / WEIGHTS_FILE).read_bytes()
        tensors = load(data)
    except (OSError, SafetensorError) as error:
        raise LoRAAdapterError(f"{where}: {WEIGHTS_FILE} is not readable ({error})") from None
    digest = adapter_digest(config.raw_bytes, data)
    del data  # the tensors are copies: the file's bytes need not stay for the adapter's life
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for tensor_name, tensor in tensors.items():
        match = _TENSOR_NAME.match(tensor_name)
        if match is None:
            raise LoRAAdapterError(f"{where}: tensor {tensor_name!r} is not supported ({_why(tensor_name)})")
        if tensor.dtype not in _FLOAT_DTYPES:
            raise LoRAAdapterError(f"{where}: tensor {tensor_name!r} is {tensor.dtype}; LoRA weights must be "
                                   "float16, bfloat16, float32 or float64")
        if not torch.isfinite(tensor).all():
            raise LoRAAdapterError(f"{where}: tensor {tensor_name!r} holds non-finite values")
        halves.setdefault(match.group(1), {})[match.group(2)] = tensor
    if not halves:
        raise LoRAAdapterError(f"{where}: {WEIGHTS_FILE} holds no LoRA tensors")
    pairs = {}
    for module, half in halves.items():
        if set(half) != {"A", "B"}:
            raise LoRAAdapterError(f"{where}: {module} has lora_{'B' if 'A' in half else 'A'} missing")
        pairs[module] = (half["A"], half["B"])
    return pairs, digest


def _why(tensor_name: str) -> str:
    if any(part in tensor_name for part in _VISION_PARTS):
        return ("LoRA on the vision tower or its connector: adapters apply to the language model's "
                "layers; train with target_modules limited to them, e.g. r'.*(text_model|language_model)"
                ".*\\.(q_proj|v_proj)'")
    if "lora_magnitude_vector" in tensor_name:
        return "DoRA"
    if "lora_embedding" in tensor_name:
        return "LoRA on embeddings"
    if tensor_name.endswith(".bias"):
        return "a trained bias"
    return "only lora_A/lora_B weights of decoder-layer projections are read"
