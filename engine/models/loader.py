"""HF checkpoint folder -> model: picks the model class from ``config.json`` and loads safetensors.

Single-file (``model.safetensors``) and sharded (``model.safetensors.index.json`` + shards)
checkpoints are both read. Every problem names what is wrong: an unsupported architecture, a
missing tensor, an unexpected tensor, a tensor of the wrong shape.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import torch
from safetensors import safe_open

from bulkinfer.engine.attention import AttentionBackend
from bulkinfer.engine.host_memory import available_memory_bytes
from bulkinfer.engine.models.gemma3 import Gemma3ForCausalLM
from bulkinfer.engine.models.idefics3 import Idefics3ForConditionalGeneration
from bulkinfer.engine.models.layers import Linear, onednn_linear_available
from bulkinfer.engine.models.llama import LlamaForCausalLM
from bulkinfer.engine.models.llama_config import LlamaFamilyConfig, UnsupportedModelError
from bulkinfer.engine.models.mapped_safetensors import mapped_tensors
from bulkinfer.engine.models.moe import MoeForCausalLM
from bulkinfer.engine.models.phi3 import Phi3ForCausalLM
from bulkinfer.engine.models.qwen2_5_vl import Qwen25VLForConditionalGeneration
from bulkinfer.engine.quant.checkpoint import (
    QuantizedCheckpointError,
    QuantizedParts,
    fuse_parts,
    split_quantized,
)
from bulkinfer.engine.quant.linear import QuantizedLinear
from bulkinfer.quant_scheme import CheckpointQuantization, UnsupportedQuantization, read_quantization

SUPPORTED_ARCHITECTURES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Qwen2MoeForCausalLM": MoeForCausalLM,
    "Qwen3MoeForCausalLM": MoeForCausalLM,
    "MixtralForCausalLM": MoeForCausalLM,
    "Idefics3ForConditionalGeneration": Idefics3ForConditionalGeneration,
    "Qwen2_5_VLForConditionalGeneration": Qwen25VLForConditionalGeneration,
}

# Tensors some exporters write that carry no weights we need (recomputed at load).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """The checkpoint folder cannot be loaded as-is; the message says which file or tensor is wrong."""


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path} not found: a model folder needs config.json")
    return json.loads(path.read_text())


def model_config_from_dir(model_dir: str | Path) -> LlamaFamilyConfig:
    """Parse ``config.json`` into the model config, rejecting architectures we do not implement."""
    cfg = read_hf_config(model_dir)
    checkpoint_quantization(model_dir, cfg)
    architectures = cfg.get("architectures") or []
    supported = [a for a in architectures if a in SUPPORTED_ARCHITECTURES]
    if not supported:
        raise UnsupportedModelError(
            f"unsupported architecture {architectures or '(none given)'} "
            f"in {Path(model_dir) / 'config.json'}; "
            f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    return SUPPORTED_ARCHITECTURES[supported[0]].parse_config(supported[0], cfg)


def checkpoint_quantization(model_dir: str | Path, cfg: dict[str, Any] | None = None
                            ) -> CheckpointQuantization | None:
    """The checkpoint's quantization (None: unquantized); a scheme the engine does not run is refused
    by name (UnsupportedModelError), before any tensor is read."""
    try:
        return read_quantization(read_hf_config(model_dir) if cfg is None else cfg)
    except UnsupportedQuantization as error:
        raise UnsupportedModelError(
            f"{Path(model_dir) / 'config.json'} is a quantized checkpoint ({error}); unquantized weights "
            "(safetensors in fp32, bf16 or fp16) and GGUF files load too") from None


def eos_token_ids(model_dir: str | Path, tokenizer: Any, config_ids: tuple[int, ...] = ()) -> list[int]:
    """Every id that ends a sequence, the tokenizer's first: the tokenizer's EOS, then config.json's
    and generation_config.json's ``eos_token_id`` (an int or a list; Llama 3 instruct lists two)."""
    ids: list[int] = []
    generation = Path(model_dir) / "generation_config.json"
    listed = json.loads(generation.read_text()).get("eos_token_id") if generation.is_file() else None
    listed = listed if isinstance(listed, list) else [] if listed is None else [listed]
    for token_id in [getattr(tokenizer, "eos_token_id", None), *config_ids, *listed]:
        if isinstance(token_id, int) and token_id not in ids:
            ids.append(token_id)
    return ids


def _tensor_files(model_dir: Path) -> list[Path]:
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({model_dir / name for name in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"shard {f.name} listed in {INDEX_FILE} is missing from {model_dir}")
        return files
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return [single]
    raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {model_dir}")


def each_checkpoint_tensor(model_dir: Path) -> Iterator[tuple[Path, Any, str]]:
    """(file, its open safetensors handle, name) for every tensor of the checkpoint the engine reads,
    each name once (one in two shards is a CheckpointError); a handle is open until the next file."""
    seen: set[str] = set()
    for path in _tensor_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                if name in seen:
                    raise CheckpointError(f"tensor {name!r} appears in more than one shard ({path.name})")
                seen.add(name)
                yield path, f, name


def read_safetensors(model_dir: str | Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, by HF name, converted to ``dtype``: views of the mapped files
    where the checkpoint already holds ``dtype``, so a load does not hold the weights twice."""
    tensors: dict[str, torch.Tensor] = {}
    for path in _tensor_files(Path(model_dir)):
        for name, tensor in mapped_tensors(path).items():
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name in tensors:
                raise CheckpointError(f"tensor {name!r} appears in more than one shard ({path.name})")
            tensors[name] = tensor.to(dtype)
    return tensors


def check_tensors(expected: dict[str, tuple[int, ...]], found: dict[str, torch.Tensor], tied: bool) -> None:
    """Raise CheckpointError naming every missing, unexpected or wrong-shape tensor."""
    # A tied checkpoint may still carry lm_head.weight (a copy of the embedding); accept it.
    problems = tensor_problems(expected, found, allowed_extra={"lm_head.weight"} if tied else set())
    if problems:
        raise CheckpointError("; ".join(problems))


def tensor_problems(expected: dict[str, tuple[int, ...]], found: dict[str, torch.Tensor],
                    allowed_extra: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """Every tensor `expected` that `found` lacks, every one it has beyond them (and `allowed_extra`),
    and every one whose shape differs, as messages."""
    problems = []
    missing = sorted(set(expected) - set(found))
    if missing:
        problems.append(f"missing tensor(s): {', '.join(missing)}")
    unexpected = sorted(set(found) - set(expected) - allowed_extra)
    if unexpected:
        problems.append(f"unexpected tensor(s): {', '.join(unexpected)}")
    for name, shape in expected.items():
        if name in found and tuple(found[name].shape) != shape:
            problems.append(f"tensor {name} has shape {tuple(found[name].shape)}, expected {shape}")
    return problems


def load_model(
    model_dir: str | Path,
    backend: AttentionBackend,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    batch_hint: int = 64,
) -> LlamaForCausalLM:
    """Build the model for ``model_dir``'s architecture and fill it from its safetensors.

    ``batch_hint``: the typical number of tokens per forward pass, for oneDNN's weight layout.
    """
    config = model_config_from_dir(model_dir)
    model_cls = SUPPORTED_ARCHITECTURES[config.architecture]
    quantization = checkpoint_quantization(model_dir)
    parts: dict[str, QuantizedParts] = {}
    if quantization is None:
        tensors = read_safetensors(model_dir, dtype)
    else:
        stored = {name: f.get_tensor(name) for _, f, name in each_checkpoint_tensor(Path(model_dir))}
        try:
            tensors, parts = split_quantized(stored, quantization, dtype)
        except QuantizedCheckpointError as error:
            raise CheckpointError(f"{model_dir}: {error}") from None
    # Built on the meta device and given uninitialized memory: every parameter is filled from the
    # checkpoint below (check_tensors), so nn's random init would be wasted (0.8 s of a SmolLM2 start).
    with torch.device("meta"):
        model = model_cls(config, backend).to(dtype)
        fused = install_quantized_projections(model, parts)
    model = model.to_empty(device=device)
    model.tie_weights()
    tensors = model.normalize_tensor_names(tensors)
    check_tensors(model.expected_hf_tensors(), tensors, tied=config.tie_word_embeddings)
    model.load_hf_tensors(tensors)
    for path, layers in fused.items():
        cast(QuantizedLinear, model.get_submodule(path)).attach(fuse_parts(path, layers, parts))
    if onednn_linear_available(torch.device(device), dtype) and packed_copy_fits(model, device):
        model.pack_linear_weights(batch_hint)
    return model.eval()


def packed_copy_fits(model: torch.nn.Module, device: str | torch.device) -> bool:
    """oneDNN keeps a packed copy of each projection's weight beside the plain one. Take it only
    where it fits in half the memory left, so it does not starve the KV cache. Otherwise F.linear
    runs on the plain weights: a few percent slower, but a model that fits once still loads."""
    available = available_memory_bytes() if torch.device(device).type == "cpu" else None
    if available is None:
        return True
    copy = sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if isinstance(m, Linear))
    if copy <= available // 2:
        return True
    logger.warning("not packing weights for oneDNN: the copy would take %.1f GiB of the %.1f GiB left",
                   copy / 2**30, available / 2**30)
    return False


def install_quantized_projections(model: LlamaForCausalLM,
                                  parts: dict[str, QuantizedParts]) -> dict[str, list[str]]:
    """Replace each projection whose checkpoint layers are quantized with a QuantizedLinear (on the
    meta device, before the weights are loaded); returns each one's layers, in concatenation order.
    Quantized layers the model has no quantized projection for are refused by name."""
    if not parts:
        return {}
    fused: dict[str, list[str]] = {}
    for path, layers in model.projection_sources().items():
        quantized = [layer in parts for layer in layers]
        if not any(quantized):
            continue
        if not all(quantized):
            raise CheckpointError(f"{path}: {', '.join(layers)} mix quantized and unquantized weights")
        if path == "lm_head":
            raise CheckpointError("lm_head is quantized: bulkinfer computes logits from a float LM head "
                                  "(llm-compressor's recipes leave it out: ignore: [lm_head])")
        linear = cast(Linear, model.get_submodule(path))
        parent, _, name = path.rpartition(".")
        replacement = QuantizedLinear(linear.in_features, linear.out_features, linear.bias is not None,
                                      parts[layers[0]].scheme)
        setattr(model.get_submodule(parent), name, replacement.to(linear.weight.dtype))  # its bias
        fused[path] = list(layers)
    covered = {layer for layers in fused.values() for layer in layers}
    left = sorted(set(parts) - covered)
    if left:
        experts = [layer for layer in left if ".experts." in layer or "shared_expert" in layer]
        what = ("quantized MoE experts are not supported yet (keep them unquantized: add them to the "
                "ignore list)" if experts else "bulkinfer runs no quantized projection for them")
        named = ", ".join(left[:4]) + (" ..." if len(left) > 4 else "")
        raise CheckpointError(f"quantized layers {named}: {what}")
    return fused
