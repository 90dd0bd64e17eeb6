"""How big a checkpoint is, before loading it: parameters, active parameters, weight memory.

Counts come from the safetensors headers (exact for any architecture, no tensor read): every
tensor's element count once (a tied checkpoint's extra ``lm_head.weight`` copy not twice). Active
parameters (what one token runs through) differ for a mixture-of-experts model: of each sparse
layer's routed experts (tensors under ``.experts.``) only ``num_experts_per_tok`` of
``num_experts`` count; the router and any shared expert always do.

Weight memory per device at tensor-parallel size N is the weights over N, rounded up: every large
tensor is split (linears by rows or columns, the embedding and LM head by vocabulary), and the few
replicated ones (norms, the router) are a rounding error. The KV cache comes on top: the engine
sizes it from the memory left after the weights.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
_HEADER_LIMIT = 100 << 20  # safetensors caps its JSON header at 100 MB


@dataclass(frozen=True)
class ModelSize:
    architecture: str
    parameters: int
    active_parameters: int
    num_experts: int = 0
    experts_per_token: int = 0
    # A quantized checkpoint: its scheme in words, the bytes its quantized weights take as the engine
    # keeps them (integers at their bits, fp32 scales and zero points), and how many parameters those are.
    scheme: str | None = None
    quantized_bytes: int = 0
    quantized_parameters: int = 0

    def weight_bytes(self, dtype: str, tensor_parallel_size: int = 1) -> int:
        """Bytes of weights one device holds at this dtype (of its unquantized ones) and tensor-parallel
        size."""
        plain = (self.parameters - self.quantized_parameters) * DTYPE_BYTES[dtype]
        return math.ceil((plain + self.quantized_bytes) / tensor_parallel_size)

    def unquantized_bytes(self, dtype: str) -> int:
        """What the same weights take unquantized at this dtype."""
        return self.parameters * DTYPE_BYTES[dtype]


def safetensors_shapes(model_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape, by name, from the headers of a single-file or sharded checkpoint."""
    folder = Path(model_dir)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({folder / name for name in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = [folder / "model.safetensors"]
    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > _HEADER_LIMIT:
                raise ValueError(f"{path}: safetensors header of {length} bytes is not plausible")
            header: dict[str, Any] = json.loads(f.read(length))
        for name, entry in header.items():
            if name != "__metadata__":
                shapes[name] = tuple(int(d) for d in entry["shape"])
    return shapes


def model_size(model_dir: str | Path) -> ModelSize:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    architecture = (config.get("architectures") or ["(none given)"])[0]
    shapes = safetensors_shapes(model_dir)
    if config.get("tie_word_embeddings") and "model.embed_tokens.weight" in shapes:
        shapes.pop("lm_head.weight", None)  # a tied copy: one tensor's memory once loaded
    scheme, quantized_parameters, quantized_bytes = _quantized(config, shapes)
    total = sum(math.prod(shape) for shape in shapes.values())
    routed = sum(math.prod(shape) for name, shape in shapes.items() if ".experts." in name)
    experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    per_token = int(config.get("num_experts_per_tok") or 0)
    active = total
    if routed and experts and 0 < per_token <= experts:
        active = total - routed + routed * per_token // experts
    return ModelSize(architecture, total, active, experts if routed else 0, per_token if routed else 0,
                     scheme, quantized_bytes, quantized_parameters)


_QUANT_PARTS = ("weight_scale", "weight_zero_point", "weight_g_idx", "weight_shape", "input_scale",
                "input_zero_point")


def _quantized(config: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> tuple[str | None, int, int]:
    """(scheme, parameters stored quantized, their bytes as the engine keeps them: integers at their
    bits, fp32 scales and zero points). Rewrites `shapes` in place to count parameters: the scales and
    the like out, each packed weight (int32 words) as its unpacked [rows, columns]."""
    from bulkinfer.quant_scheme import UnsupportedQuantization, quantization_scheme, read_quantization

    scheme = quantization_scheme(config)
    if scheme is None:
        return None, 0, 0
    try:
        quant = read_quantization(config)
    except UnsupportedQuantization:
        quant = None
    count = size = 0
    for name in [n for n in shapes if n.endswith(".weight_scale")]:
        layer = name.removesuffix(".weight_scale")
        layer_scheme = quant.scheme_for(layer) if quant is not None else None
        bits = layer_scheme.weights.bits if layer_scheme is not None else 8
        packed = shapes.pop(layer + ".weight_packed", None)
        weight = shapes.get(layer + ".weight")
        if packed is not None:  # 32 // bits values a word (the last word may be part padding)
            weight = shapes[layer + ".weight"] = (packed[0], packed[1] * 32 // bits)
        if weight is None or len(weight) != 2:
            continue
        count += weight[0] * weight[1]
        size += weight[0] * weight[1] * bits // 8
    for name in [n for n in shapes if n.rpartition(".")[2] in _QUANT_PARTS]:
        shape = shapes.pop(name)
        if name.endswith((".weight_scale", ".weight_zero_point")):
            size += math.prod(shape) * 4  # kept as fp32 (a packed zero point unpacks to more: close enough)
    return scheme, count, size


def format_parameters(count: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.2f}{unit}"
    return str(count)


def format_bytes(count: int) -> str:
    return f"{count / (1 << 30):.2f} GiB" if count >= 1 << 30 else f"{count / (1 << 20):.1f} MiB"


def describe_size(size: ModelSize, tensor_parallel_sizes: tuple[int, ...] = (1, 2, 4, 8)) -> list[str]:
    """Lines for `bulkinfer models list`: architecture, parameters, and a weights-per-device table."""
    active = ("all active" if size.active_parameters == size.parameters else
              f"{format_parameters(size.active_parameters)} active: {size.experts_per_token} of "
              f"{size.num_experts} experts a token")
    lines = [f"{size.architecture}: {format_parameters(size.parameters)} parameters ({active})"]
    if size.scheme is not None:
        saved = 1 - size.weight_bytes("bfloat16") / size.unquantized_bytes("bfloat16")
        count, held = format_parameters(size.quantized_parameters), format_bytes(size.quantized_bytes)
        quantized = f"{count} parameters in {held}"
        lines.append(f"quantized: {size.scheme}; {quantized}: the weights take {saved:.0%} less than in bf16")
    lines.append("weights per device  " + "".join(f"{f'TP={tp}':>12}" for tp in tensor_parallel_sizes))
    for dtype in DTYPE_BYTES:
        cells = "".join(f"{format_bytes(size.weight_bytes(dtype, tp)):>12}" for tp in tensor_parallel_sizes)
        lines.append(f"  {dtype:<18}{cells}")
    lines.append("  (the KV cache comes on top: the engine sizes it from the memory the weights leave)")
    return lines
