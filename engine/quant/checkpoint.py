"""A compressed-tensors checkpoint's quantized layers, read and unpacked: each layer's integer weights
(int8 storage, -8..7 for 4 bits) under its plain ``.weight`` name (so a model loads them as it loads
float weights, fusing q/k/v and gate/up by concatenation), and the rest of it (scales, zero points,
static activation scales) in ``QuantizedParts`` by layer.

Tensors per layer, as compressed-tensors writes them:
- int-quantized: ``weight`` (int8 [n, k]), ``weight_scale`` ([n, 1] per channel, [n, k / group] per
  group, one value per tensor), ``weight_zero_point`` (asymmetric), ``input_scale`` and
  ``input_zero_point`` (static activations);
- pack-quantized: ``weight_packed`` (int32 [n, ceil(k * bits / 32)], the values + 2^(bits-1) packed
  low bits first), ``weight_shape`` ([n, k]), the scales as above, and zero points packed the same
  way along the output dimension.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bulkinfer.quant_scheme import CheckpointQuantization, LayerScheme

WEIGHT_SUFFIXES = ("weight_scale", "weight_zero_point", "weight_packed", "weight_shape", "weight_g_idx",
                   "input_scale", "input_zero_point")


class QuantizedCheckpointError(ValueError):
    """The quantized tensors do not fit the checkpoint's scheme; the message names the layer."""


@dataclass
class QuantizedParts:
    """One layer's quantization besides its integer weights: fp32 scales ``[n, groups]``, zero
    points as fp32 ``[n, groups]`` (None: symmetric), the group size (k for one per channel), and
    a static activation scale and zero point (int8 terms) where the scheme has them."""

    scheme: LayerScheme
    scales: torch.Tensor
    zero_points: torch.Tensor | None
    group_size: int
    input_scale: float | None = None
    input_zero_point: int = 0


def split_quantized(tensors: dict[str, torch.Tensor], quant: CheckpointQuantization,
                    float_dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict[str, QuantizedParts]]:
    """(every tensor the model loads by name, with each quantized layer's integer weights as its
    ``.weight`` and every float tensor in ``float_dtype``; each quantized layer's parts by its HF
    name, e.g. "model.layers.0.self_attn.q_proj"). ``tensors``: the checkpoint's, as stored."""
    by_layer: dict[str, dict[str, torch.Tensor]] = {}
    plain: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        layer, _, suffix = name.rpartition(".")
        if suffix in WEIGHT_SUFFIXES:
            by_layer.setdefault(layer, {})[suffix] = tensor
        else:
            plain[name] = tensor
    parts: dict[str, QuantizedParts] = {}
    for layer, found in by_layer.items():
        scheme = quant.scheme_for(layer)
        if scheme is None:
            raise QuantizedCheckpointError(
                f"{layer} has quantized tensors ({', '.join(sorted(found))}) but no config group targets it "
                "(or it is in the ignore list)")
        values = _integer_weights(layer, found, plain, scheme)
        plain[f"{layer}.weight"] = values
        parts[layer] = _parts(layer, found, scheme, values.shape)
    for name in list(plain):
        layer = name.removesuffix(".weight")
        if name.endswith(".weight") and layer in parts:
            continue  # a quantized layer's integer values, kept as they are
        tensor = plain[name]
        targeted = quant.scheme_for(layer) if name.endswith("_proj.weight") and tensor.dim() == 2 else None
        if targeted is not None:
            raise QuantizedCheckpointError(
                f"{layer} is targeted by the quantization config ({targeted.name}) but stored unquantized "
                "(no weight_scale beside it)")
        if name.endswith(".weight") and tensor.dtype in (torch.int8, torch.int32):
            raise QuantizedCheckpointError(f"{name} is stored as integers but has no weight_scale")
        plain[name] = tensor.to(float_dtype)
    return plain, parts


def unpack_int32(packed: torch.Tensor, bits: int, length: int, dim: int = 1) -> torch.Tensor:
    """compressed-tensors' ``pack_to_int32`` undone: signed int8 values, ``length`` along ``dim``."""
    if dim == 0:
        return unpack_int32(packed.t(), bits, length, 1).t().contiguous()
    per_word = 32 // bits
    words = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    fields = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    values = fields.reshape(packed.shape[0], -1)[:, :length] - (1 << (bits - 1))
    return values.to(torch.int8).contiguous()


def _integer_weights(layer: str, found: dict[str, torch.Tensor], plain: dict[str, torch.Tensor],
                     scheme: LayerScheme) -> torch.Tensor:
    bits = scheme.weights.bits
    if "weight_g_idx" in found:
        raise QuantizedCheckpointError(f"{layer}.weight_g_idx: activation-ordered groups are not supported")
    if "weight_packed" in found:
        shape = found.get("weight_shape")
        if shape is None:
            raise QuantizedCheckpointError(f"{layer}.weight_packed has no weight_shape beside it")
        rows, cols = (int(v) for v in shape.flatten().tolist())
        packed = found["weight_packed"]
        if packed.dtype != torch.int32 or packed.shape[0] != rows or packed.shape[1] * 32 < cols * bits:
            raise QuantizedCheckpointError(
                f"{layer}.weight_packed is {packed.dtype} {tuple(packed.shape)}, which does not hold "
                f"{rows}x{cols} {bits}-bit values")
        return unpack_int32(packed, bits, cols)
    values = plain.pop(f"{layer}.weight", None)
    if values is None:
        raise QuantizedCheckpointError(f"{layer} has a weight_scale but no weight or weight_packed")
    if values.dtype != torch.int8:
        raise QuantizedCheckpointError(f"{layer}.weight is {values.dtype}, expected int8 ({scheme.format})")
    low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    if bits < 8 and (int(values.min()) < low or int(values.max()) > high):
        raise QuantizedCheckpointError(f"{layer}.weight holds values outside {bits}-bit range")
    return values.contiguous()


def _parts(layer: str, found: dict[str, torch.Tensor], scheme: LayerScheme,
           shape: tuple[int, ...] | torch.Size) -> QuantizedParts:
    rows, cols = int(shape[0]), int(shape[1])
    group = scheme.weights.group_size or cols
    groups = -(-cols // group)
    scale = found.get("weight_scale")
    if scale is None:
        raise QuantizedCheckpointError(f"{layer} has no weight_scale")
    scale = scale.float()
    if scale.numel() == 1:
        scale = scale.reshape(1, 1).expand(rows, 1)
    if tuple(scale.shape) != (rows, groups):
        raise QuantizedCheckpointError(
            f"{layer}.weight_scale has shape {tuple(scale.shape)}, expected {(rows, groups)} "
            f"for {rows}x{cols} weights{f' in groups of {group}' if scheme.weights.group_size else ''}")
    zero_points = None
    if not scheme.weights.symmetric:
        zero = found.get("weight_zero_point")
        if zero is None:
            raise QuantizedCheckpointError(f"{layer} is asymmetric but has no weight_zero_point")
        if zero.dtype == torch.int32 and zero.shape[0] != rows:  # packed along the output dimension
            zero = unpack_int32(zero, scheme.weights.bits, rows, dim=0)
        if zero.numel() == 1:
            zero = zero.reshape(1, 1).expand(rows, 1)
        if tuple(zero.shape) != (rows, groups):
            raise QuantizedCheckpointError(
                f"{layer}.weight_zero_point has shape {tuple(zero.shape)}, expected {(rows, groups)}")
        zero_points = zero.float().contiguous()
    parts = QuantizedParts(scheme, scale.contiguous(), zero_points, group)
    activations = scheme.activations
    if activations is not None and not activations.dynamic:
        input_scale = found.get("input_scale")
        if input_scale is None or input_scale.numel() != 1:
            raise QuantizedCheckpointError(f"{layer} has static activations but no single input_scale")
        parts.input_scale = float(input_scale.float().item())
        if not activations.symmetric:
            input_zero = found.get("input_zero_point")
            if input_zero is None or input_zero.numel() != 1:
                raise QuantizedCheckpointError(
                    f"{layer} has asymmetric static activations but no input_zero_point")
            parts.input_zero_point = int(input_zero.item())
    return parts


def fuse_parts(module: str, layers: list[str], parts: dict[str, QuantizedParts]) -> QuantizedParts:
    """The parts of one fused projection (q/k/v, gate/up) from its layers', in the order the weights
    are concatenated. Static activation scales become the largest of them (one input, one scale)."""
    chosen = [parts[layer] for layer in layers]
    first = chosen[0]
    if any(part.scheme != first.scheme or part.group_size != first.group_size for part in chosen):
        raise QuantizedCheckpointError(f"{module}: {', '.join(layers)} are quantized differently")
    if len({part.input_zero_point for part in chosen}) > 1:
        raise QuantizedCheckpointError(f"{module}: {', '.join(layers)} have different activation zero points")
    zero_points = None
    if first.zero_points is not None:
        zero_points = torch.cat([part.zero_points for part in chosen if part.zero_points is not None])
    scales = [part.input_scale for part in chosen if part.input_scale is not None]
    return QuantizedParts(first.scheme, torch.cat([part.scales for part in chosen]).contiguous(), zero_points,
                          first.group_size, max(scales) if scales else None, first.input_zero_point)
