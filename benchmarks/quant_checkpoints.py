"""compressed-tensors checkpoints written from a float one, as llm-compressor writes them: scales and
integer weights from compressed-tensors' own functions (calculate_qparams, quantize, pack_to_int32),
its config as its QuantizationConfig serializes. Beside each, a float "twin": the same model with the
dequantized weights, the reference transformers runs.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
from compressed_tensors.quantization.utils import calculate_qparams
from safetensors.torch import load_file, save_file

PROJECTION = re.compile(
    r"model\.layers\.\d+\.(self_attn|mlp)\.(experts\.\d+\.|shared_expert\.)?\w+_proj\.weight$")


def ignored(layer: str, ignore: tuple[str, ...]) -> bool:
    """compressed-tensors' matching: "re:<regex>" over the layer name, else the name (or its end)."""
    return any(re.match(p[3:], layer) if p.startswith("re:") else layer.endswith(p) for p in ignore)


def weight_args(bits: int, group_size: int | None, symmetric: bool) -> QuantizationArgs:
    strategy = "group" if group_size else "channel"
    return QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy=strategy,
                            group_size=group_size)


def activation_args(static: bool, symmetric: bool) -> QuantizationArgs:
    return QuantizationArgs(num_bits=8, type="int", symmetric=symmetric,
                            strategy="tensor" if static else "token", dynamic=not static)


def _qparams(weight: torch.Tensor, args: QuantizationArgs) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = weight.shape
    if args.group_size:
        groups = -(-cols // args.group_size)  # the last group may be partial
        size = args.group_size
        low = torch.stack([weight[:, g * size:(g + 1) * size].amin(1) for g in range(groups)], 1)
        high = torch.stack([weight[:, g * size:(g + 1) * size].amax(1) for g in range(groups)], 1)
        return calculate_qparams(low, high, args)
    return calculate_qparams(weight.amin(1, keepdim=True), weight.amax(1, keepdim=True), args)


def write_quantized_checkpoint(source: Path, target: Path, bits: int = 8, group_size: int | None = None,
                               symmetric: bool = True, activations: QuantizationArgs | None = None,
                               packed: bool | None = None, input_scales: dict[str, float] | None = None,
                               ignore: tuple[str, ...] = ("lm_head",), input_zero_point: int = 0) -> Path:
    """`source`'s projections quantized into `target` (a folder), and their dequantized twin in
    `target`-float; returns `target`. `input_scales`: static activation scales by layer (and, for
    asymmetric ones, `input_zero_point` for every layer)."""
    packed = bits < 8 if packed is None else packed
    twin = target.with_name(target.name + "-float")
    for folder in (target, twin):
        shutil.copytree(source, folder, dirs_exist_ok=True)
    tensors = load_file(str(source / "model.safetensors"))
    args = weight_args(bits, group_size, symmetric)
    quantized: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        layer = name.removesuffix(".weight")
        if not PROJECTION.match(name) or ignored(layer, ignore):
            quantized[name] = dequantized[name] = tensor
            continue
        weight = tensor.float()
        scale, zero = _qparams(weight, args)
        values = quantize(weight, scale, zero, args, dtype=torch.int8)
        dequantized[name] = dequantize(values, scale, zero, args).to(tensor.dtype)
        quantized[layer + ".weight_scale"] = scale.to(tensor.dtype)
        if packed:
            quantized[layer + ".weight_packed"] = pack_to_int32(values, bits)
            quantized[layer + ".weight_shape"] = torch.tensor(list(weight.shape), dtype=torch.int64)
        else:
            quantized[name] = values
        if not symmetric:
            zero = zero.to(torch.int8)
            stored = pack_to_int32(zero, bits, packed_dim=0) if packed else zero
            quantized[layer + ".weight_zero_point"] = stored
        if input_scales is not None:
            quantized[layer + ".input_scale"] = torch.tensor([input_scales[layer]], dtype=tensor.dtype)
            if activations is not None and not activations.symmetric:
                quantized[layer + ".input_zero_point"] = torch.tensor([input_zero_point], dtype=torch.int8)
    save_file(quantized, str(target / "model.safetensors"))
    save_file(dequantized, str(twin / "model.safetensors"))
    scheme = QuantizationScheme(targets=["Linear"], weights=args, input_activations=activations)
    quant = QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(ignore),
                               format="pack-quantized" if packed else "int-quantized",
                               quantization_status="compressed")
    config = json.loads((source / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "quantization_config": quant.model_dump(
        exclude_none=True, mode="json")}))
    return target


def fake_quantize_inputs(model: torch.nn.Module, activations: QuantizationArgs,
                         input_scales: dict[str, float] | None = None) -> None:
    """Quantize every projection's input as a W8A8 checkpoint's activations are (transformers
    reference: forward pre-hooks on each decoder layer's Linear)."""
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or not name.startswith("model.layers."):
            continue

        def hook(_: torch.nn.Module, inputs: tuple[torch.Tensor, ...],
                 layer: str = name) -> tuple[torch.Tensor]:
            x = inputs[0].float()
            if input_scales is not None:
                scale = torch.tensor(input_scales[layer])
                q = torch.clamp(torch.round(x / scale), -128, 127)
                return ((q * scale).to(inputs[0].dtype),)
            absmax = x.abs().amax(-1, keepdim=True)
            scale = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))
            q = torch.clamp(torch.round(x / scale), -127, 127)
            return ((q * scale).to(inputs[0].dtype),)

        module.register_forward_pre_hook(hook)


def calibrate_input_scales(model_dir: Path, prompts: list[list[int]]) -> dict[str, float]:
    """Static activation scales: each projection's largest input on `prompts`, over 127."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    largest: dict[str, float] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.startswith("model.layers."):
            def hook(_: torch.nn.Module, inputs: tuple[torch.Tensor, ...], layer: str = name) -> None:
                largest[layer] = max(largest.get(layer, 0.0), float(inputs[0].abs().max()))
            module.register_forward_pre_hook(hook)
    with torch.no_grad():
        for prompt in prompts:
            model(torch.tensor([prompt]))
    return {layer: value / 127.0 for layer, value in largest.items()}
