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

    def weight_bytes(self, dtype: str, tensor_parallel_size: int = 1) -> int:
        """Bytes of weights one device holds at this dtype and tensor-parallel size."""
        return math.ceil(self.parameters * DTYPE_BYTES[dtype] / tensor_parallel_size)


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
    total = sum(math.prod(shape) for shape in shapes.values())
    routed = sum(math.prod(shape) for name, shape in shapes.items() if ".experts." in name)
    experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    per_token = int(config.get("num_experts_per_tok") or 0)
    active = total
    if routed and experts and 0 < per_token <= experts:
        active = total - routed + routed * per_token // experts
    return ModelSize(architecture, total, active, experts if routed else 0, per_token if routed else 0)


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
    lines = [f"{size.architecture}: {format_parameters(size.parameters)} parameters ({active})",
             "weights per device  " + "".join(f"{f'TP={tp}':>12}" for tp in tensor_parallel_sizes)]
    for dtype in DTYPE_BYTES:
        cells = "".join(f"{format_bytes(size.weight_bytes(dtype, tp)):>12}" for tp in tensor_parallel_sizes)
        lines.append(f"  {dtype:<18}{cells}")
    lines.append("  (the KV cache comes on top: the engine sizes it from the memory the weights leave)")
    return lines
