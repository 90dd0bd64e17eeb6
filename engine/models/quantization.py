"""A quantized checkpoint's scheme in words, read from its config.json (`quantization_config`), so
one the engine cannot load is refused by name before any tensor is read, not with a list of
tensors it does not expect (`weight_scale`, `qweight`, ...)."""

from __future__ import annotations

from typing import Any


def quantization_scheme(config: dict[str, Any]) -> str | None:
    """How the checkpoint's weights are quantized, e.g. "compressed-tensors W8A8 int8 (int-quantized:
    channel weights, dynamic token activations)"; None for a checkpoint that is not."""
    quant = config.get("quantization_config")
    if not quant:
        return None
    if not isinstance(quant, dict):
        return f"quantization_config {quant!r}"
    method = str(quant.get("quant_method") or "unknown method")
    if method != "compressed-tensors":
        bits = quant.get("bits") or quant.get("w_bit")
        return f"{method}{f' {bits}-bit' if bits else ''}"
    groups = [group for group in (quant.get("config_groups") or {}).values() if isinstance(group, dict)]
    described = sorted({_group_words(group) for group in groups}) or ["no config_groups"]
    fmt = quant.get("format")
    return "compressed-tensors " + "; ".join(f"{headline} ({fmt + ': ' if fmt else ''}{details})"
                                             for headline, details in described)


def _group_words(group: dict[str, Any]) -> tuple[str, str]:
    """One config group: "W8A8 int8" and how: its weights' strategy (group size), its activations'
    (dynamic or static), and asymmetry."""
    weights = group.get("weights") or {}
    activations = group.get("input_activations") or {}
    w_bits = weights.get("num_bits", "?")
    a_bits = activations.get("num_bits", 16) if activations else 16
    headline = f"W{w_bits}A{a_bits} {weights.get('type', 'int')}{w_bits}"
    strategy = str(weights.get("strategy") or "tensor")
    if weights.get("group_size"):
        strategy += f" {weights['group_size']}"
    details = [f"{strategy} weights"]
    if activations:
        dynamic = "dynamic" if activations.get("dynamic") else "static"
        details.append(f"{dynamic} {activations.get('strategy', 'tensor')} activations")
    if weights.get("symmetric") is False:
        details.append("asymmetric")
    return headline, ", ".join(details)
