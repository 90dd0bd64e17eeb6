"""A quantized checkpoint's scheme, read from its config.json (`quantization_config`), without torch:
the engine loads by it, and the job side (catalog, manifests, POST /jobs) names and checks it.

compressed-tensors (what llm-compressor writes, the format vLLM loads natively) is described as
config groups, each a list of `targets` (a layer class such as "Linear", a module name, or
"re:<regex>" over module names) with `weights` and optional `input_activations` arguments, plus
an `ignore` list of modules left unquantized. What the engine runs (`unsupported_reason` says why
anything else is refused, naming the scheme):

- W8A8 int8: 8-bit symmetric weights per channel (or per tensor), activations quantized to 8 bits
  per token at run time (dynamic) or with a stored per-tensor scale (static), symmetric or not;
- W8A16 / W4A16: 8- or 4-bit weights per channel or in groups along the input, symmetric or with
  zero points, activations left in the model's dtype;
in the `int-quantized` (int8 tensors) and `pack-quantized` (int32 words) formats.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

COMPRESSED_TENSORS = "compressed-tensors"
FORMATS = ("int-quantized", "pack-quantized", "naive-quantized")  # naive: int-quantized's older name
LINEAR = "Linear"  # the target that names every linear layer


@dataclass(frozen=True)
class WeightQuant:
    """How one layer's weights are stored: `bits` signed integers times a scale per output channel
    (`group_size` None) or per `group_size` inputs of a channel; `symmetric` False: with a zero
    point beside each scale."""

    bits: int
    group_size: int | None
    symmetric: bool
    per_tensor: bool = False  # one scale for the whole tensor (run as that scale on every channel)


@dataclass(frozen=True)
class ActivationQuant:
    """How a W8A8 layer's inputs are quantized to 8 bits: `dynamic` per token at run time (or per
    call, `per_token` False), else with the checkpoint's static per-tensor scale."""

    dynamic: bool
    per_token: bool
    symmetric: bool


@dataclass(frozen=True)
class LayerScheme:
    weights: WeightQuant
    activations: ActivationQuant | None  # None: weight-only (activations stay 16/32-bit)
    format: str

    @property
    def name(self) -> str:
        """"W8A8", "W4A16": the scheme as llm-compressor's presets name it."""
        return f"W{self.weights.bits}A{8 if self.activations else 16}"


@dataclass(frozen=True)
class CheckpointQuantization:
    """A checkpoint's quantization: its config groups in order (the first whose targets match a
    module is the module's scheme, as compressed-tensors applies them) and its ignore list."""

    description: str
    groups: tuple[tuple[tuple[str, ...], LayerScheme], ...]
    ignore: tuple[str, ...]

    def scheme_for(self, module: str, class_name: str = LINEAR) -> LayerScheme | None:
        """The scheme of the linear layer named `module` (e.g. "model.layers.0.self_attn.q_proj"),
        None where it is ignored or no group targets it (it is stored unquantized)."""
        if any(_matches(pattern, module, class_name) for pattern in self.ignore):
            return None
        for targets, scheme in self.groups:
            if any(_matches(pattern, module, class_name) for pattern in targets):
                return scheme
        return None

    @property
    def schemes(self) -> list[str]:
        """The distinct scheme names, e.g. ["W4A16"]."""
        return sorted({scheme.name for _, scheme in self.groups})


class UnsupportedQuantization(ValueError):
    """The checkpoint is quantized in a scheme the engine does not run; the message names it."""


def _matches(pattern: str, module: str, class_name: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return pattern in (module, class_name) or module.endswith("." + pattern)


def quantization_scheme(config: dict[str, Any]) -> str | None:
    """How the checkpoint's weights are quantized, e.g. "compressed-tensors W8A8 int8 (int-quantized:
    channel weights, dynamic token activations)"; None for a checkpoint that is not."""
    quant = config.get("quantization_config")
    if not quant:
        return None
    if not isinstance(quant, dict):
        return f"quantization_config {quant!r}"
    method = str(quant.get("quant_method") or "unknown method")
    if method != COMPRESSED_TENSORS:
        bits = quant.get("bits") or quant.get("w_bit")
        return f"{method}{f' {bits}-bit' if bits else ''}"
    groups = [group for group in (quant.get("config_groups") or {}).values() if isinstance(group, dict)]
    described = sorted({_group_words(group) for group in groups}) or [("no config_groups", "")]
    fmt = quant.get("format")
    parts = [f"{headline} ({fmt + ': ' if fmt else ''}{details})" if details or fmt else headline
             for headline, details in described]
    return f"{COMPRESSED_TENSORS} " + "; ".join(parts)


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


def read_quantization(config: dict[str, Any]) -> CheckpointQuantization | None:
    """The checkpoint's quantization as the engine runs it; None for an unquantized checkpoint.
    Raises UnsupportedQuantization naming the scheme and what of it the engine does not run."""
    description = quantization_scheme(config)
    if description is None:
        return None
    quant = config["quantization_config"]
    if not isinstance(quant, dict) or quant.get("quant_method") != COMPRESSED_TENSORS:
        raise UnsupportedQuantization(
            f"{description} is not a scheme bulkinfer runs: it loads compressed-tensors checkpoints "
            "(W8A8 int8, W8A16, W4A16)")
    problems = []
    for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if quant.get(key):
            problems.append(f"{key.replace('_', ' ')} is not supported")
    top_format = quant.get("format")
    groups = []
    for name, group in (quant.get("config_groups") or {}).items():
        try:
            groups.append((_targets(group, name), _layer_scheme(group, top_format)))
        except UnsupportedQuantization as error:
            problems.append(f"{name}: {error}")
    if not groups and not problems:
        problems.append("no config_groups")
    if problems:
        raise UnsupportedQuantization(f"{description}: {'; '.join(problems)}. bulkinfer runs compressed-"
                                      "tensors W8A8 int8 and int8/int4 weight-only (W8A16, W4A16) schemes")
    ignore = tuple(str(pattern) for pattern in quant.get("ignore") or ())
    return CheckpointQuantization(description, tuple(groups), ignore)


def _targets(group: dict[str, Any], name: str) -> tuple[str, ...]:
    targets = group.get("targets") or []
    if isinstance(targets, str):
        targets = [targets]
    if not targets:
        raise UnsupportedQuantization(f"group {name} targets no layer")
    return tuple(str(target) for target in targets)


def _layer_scheme(group: dict[str, Any], top_format: str | None) -> LayerScheme:
    fmt = group.get("format") or top_format or "int-quantized"
    if fmt not in FORMATS:
        raise UnsupportedQuantization(f"format {fmt!r} (supported: int-quantized, pack-quantized)")
    if group.get("output_activations"):
        raise UnsupportedQuantization("quantized output activations")
    weights = group.get("weights")
    if not isinstance(weights, dict):
        raise UnsupportedQuantization("no weights arguments")
    kind, bits = weights.get("type", "int"), weights.get("num_bits")
    if kind != "int" or bits not in (4, 8):
        raise UnsupportedQuantization(f"{kind}{bits} weights (supported: int8, int4)")
    strategy = weights.get("strategy") or "tensor"
    if strategy not in ("channel", "group", "tensor"):
        raise UnsupportedQuantization(f"{strategy} weight strategy (supported: channel, group, tensor)")
    group_size = weights.get("group_size") if strategy == "group" else None
    if strategy == "group" and (not isinstance(group_size, int) or group_size <= 0):
        raise UnsupportedQuantization(f"group strategy with group_size {group_size!r}")
    if weights.get("actorder") == "group":
        raise UnsupportedQuantization("activation-ordered groups (actorder: group, a g_idx per weight)")
    if weights.get("dynamic"):
        raise UnsupportedQuantization("dynamic weights")
    weight_quant = WeightQuant(int(bits), group_size, weights.get("symmetric", True) is not False,
                               per_tensor=strategy == "tensor")
    activations = group.get("input_activations")
    if not activations:
        return LayerScheme(weight_quant, None, fmt)
    a_kind, a_bits = activations.get("type", "int"), activations.get("num_bits")
    if a_kind != "int" or a_bits != 8:
        raise UnsupportedQuantization(f"{a_kind}{a_bits} activations (supported: int8, or none)")
    if bits != 8 or group_size is not None or not weight_quant.symmetric:
        raise UnsupportedQuantization(
            f"W{bits}A8 with {strategy}{' asymmetric' if not weight_quant.symmetric else ''} weights "
            "(int8 activations run with symmetric int8 weights per channel or tensor)")
    a_strategy = activations.get("strategy") or "tensor"
    dynamic = bool(activations.get("dynamic"))
    if a_strategy not in ("token", "tensor") or (a_strategy == "token" and not dynamic):
        raise UnsupportedQuantization(f"{'dynamic' if dynamic else 'static'} {a_strategy} activations "
                                      "(supported: dynamic per token, dynamic or static per tensor)")
    activation_quant = ActivationQuant(dynamic, a_strategy == "token",
                                       activations.get("symmetric", True) is not False)
    return LayerScheme(weight_quant, activation_quant, fmt)
