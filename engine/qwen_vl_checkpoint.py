"""A random-weight Qwen2.5-VL checkpoint in Hugging Face's format: config in transformers 5's form,
tensors under the published checkpoints' names (`visual.*`, `model.*`), our byte-level BPE plus Qwen's
vision tokens, Qwen2-VL's chat template, and `preprocessor_config.json` for transformers'
`Qwen2VLImageProcessor`. Presets: `tiny` for tests (pictures of 56 x 56 to 112 x 112 pixels) and
`qwen2.5-vl-3b` (Qwen2.5-VL-3B-Instruct's shape and processor limits) for `bench vision`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from bulkinfer.engine.checkpoints import _cache_key, _init_tensor, _tensor_seed, _write_json, cache_dir
from bulkinfer.engine.vision_checkpoints import FORMAT_VERSION, _token_id, build_in_place, save_tokenizer_with

QWEN_VL_ARCHITECTURE = "Qwen2_5_VLForConditionalGeneration"
QWEN_VL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# Qwen2-VL's own template (Qwen/Qwen2.5-VL-*-Instruct), less its video and numbering options.
QWEN_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
@dataclass(frozen=True)
class QwenVLPreset:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab_base: int  # our BPE's own merges, before the vision tokens
    vocab: int  # the config's vocab_size (at least the tokenizer's length)
    mrope_section: tuple[int, int, int]
    rope_theta: float
    tie_embeddings: bool
    vision_hidden: int
    vision_depth: int
    vision_heads: int
    vision_intermediate: int
    window_size: int
    fullatt_blocks: tuple[int, ...]
    min_pixels: int
    max_pixels: int


QWEN_VL_PRESETS = {
    "tiny": QwenVLPreset(64, 2, 4, 2, 128, 512, 0, (2, 3, 3), 10000.0, False,
                         32, 2, 2, 64, 56, (1,), 56 * 56, 112 * 112),
    # Qwen/Qwen2.5-VL-3B-Instruct's shape (3.75 B parameters): for `bench vision --family qwen2_5_vl`.
    "qwen2.5-vl-3b": QwenVLPreset(2048, 36, 16, 2, 11008, 49152, 151936, (16, 24, 24), 1000000.0, True,
                                  1280, 32, 16, 3420, 112, (7, 15, 23, 31), 56 * 56, 28 * 28 * 16384),
}
SHARD_BYTES = 2 << 30  # big presets are written as shards, so no more than one shard sits in memory


def qwen_vl_shapes(vocab: int, preset: str = "tiny") -> dict[str, tuple[int, ...]]:
    """Every tensor of a Qwen2.5-VL preset by its published name (`visual.*`, `model.*`)."""
    p = QWEN_VL_PRESETS[preset]
    h, kv, inner = p.hidden, p.kv_heads * (p.hidden // p.heads), p.intermediate
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    if not p.tie_embeddings:
        shapes["lm_head.weight"] = (vocab, h)
    for i in range(p.layers):
        pre = f"model.layers.{i}."
        for name, rows in (("q_proj", h), ("k_proj", kv), ("v_proj", kv)):
            shapes[f"{pre}self_attn.{name}.weight"], shapes[f"{pre}self_attn.{name}.bias"] = (
                (rows, h),
                (rows,),
            )
        shapes.update(
            {
                pre + "self_attn.o_proj.weight": (h, h),
                pre + "input_layernorm.weight": (h,),
                pre + "post_attention_layernorm.weight": (h,),
                pre + "mlp.gate_proj.weight": (inner, h),
                pre + "mlp.up_proj.weight": (inner, h),
                pre + "mlp.down_proj.weight": (h, inner),
            }
        )
    v, vi = p.vision_hidden, p.vision_intermediate
    shapes["visual.patch_embed.proj.weight"] = (v, 3, 2, 14, 14)
    for i in range(p.vision_depth):
        pre = f"visual.blocks.{i}."
        shapes.update(
            {
                pre + "norm1.weight": (v,),
                pre + "norm2.weight": (v,),
                pre + "attn.qkv.weight": (3 * v, v),
                pre + "attn.qkv.bias": (3 * v,),
                pre + "attn.proj.weight": (v, v),
                pre + "attn.proj.bias": (v,),
            }
        )
        for name, out_dim, in_dim in (("gate_proj", vi, v), ("up_proj", vi, v), ("down_proj", v, vi)):
            shapes[f"{pre}mlp.{name}.weight"], shapes[f"{pre}mlp.{name}.bias"] = (out_dim, in_dim), (out_dim,)
    shapes.update(
        {
            "visual.merger.ln_q.weight": (v,),
            "visual.merger.mlp.0.weight": (4 * v, 4 * v),
            "visual.merger.mlp.0.bias": (4 * v,),
            "visual.merger.mlp.2.weight": (h, 4 * v),
            "visual.merger.mlp.2.bias": (h,),
        }
    )
    return shapes


def build_qwen_vl_checkpoint(path: str | Path, seed: int = 0, preset: str = "tiny") -> Path:
    """A random Qwen2.5-VL folder (config in transformers 5's form, tensors in the published
    checkpoints' names), built beside `path` and renamed into place."""
    return build_in_place(path, lambda tmp: _write(tmp, seed, preset))


def _write(tmp: Path, seed: int, preset: str) -> None:
    p = QWEN_VL_PRESETS[preset]
    tokenizer = save_tokenizer_with(tmp, p.vocab_base, QWEN_VL_TOKENS, QWEN_VL_CHAT_TEMPLATE)
    vocab = max(len(tokenizer), p.vocab_base + len(QWEN_VL_TOKENS), p.vocab)
    ids = {token: _token_id(tokenizer, token) for token in QWEN_VL_TOKENS}
    _write_json(
        tmp / "config.json",
        {
            "architectures": [QWEN_VL_ARCHITECTURE],
            "model_type": "qwen2_5_vl",
            "tie_word_embeddings": p.tie_embeddings,
            "image_token_id": ids["<|image_pad|>"],
            "video_token_id": ids["<|video_pad|>"],
            "vision_start_token_id": ids["<|vision_start|>"],
            "vision_end_token_id": ids["<|vision_end|>"],
            "text_config": {
                "model_type": "qwen2_5_vl_text",
                "vocab_size": vocab,
                "hidden_size": p.hidden,
                "intermediate_size": p.intermediate,
                "num_hidden_layers": p.layers,
                "num_attention_heads": p.heads,
                "num_key_value_heads": p.kv_heads,
                "hidden_act": "silu",
                "rms_norm_eps": 1e-6,
                "max_position_embeddings": 4096,
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": p.rope_theta,
                    "mrope_section": list(p.mrope_section),
                },
                "bos_token_id": 0,
                "eos_token_id": 1,
                "tie_word_embeddings": p.tie_embeddings,
            },
            "vision_config": {
                "model_type": "qwen2_5_vl_vision",
                "depth": p.vision_depth,
                "hidden_size": p.vision_hidden,
                "intermediate_size": p.vision_intermediate,
                "num_heads": p.vision_heads,
                "out_hidden_size": p.hidden,
                "patch_size": 14,
                "spatial_merge_size": 2,
                "temporal_patch_size": 2,
                "window_size": p.window_size,
                "fullatt_block_indexes": list(p.fullatt_blocks),
                "hidden_act": "silu",
                "in_channels": 3,
            },
        },
    )
    _write_json(tmp / "generation_config.json", {"bos_token_id": 0, "eos_token_id": [1], "pad_token_id": 2})
    _write_json(
        tmp / "preprocessor_config.json",
        {
            "image_processor_type": "Qwen2VLImageProcessor",
            "processor_class": "Qwen2_5_VLProcessor",
            "do_convert_rgb": True,
            "do_resize": True,
            "resample": 3,
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": [0.48145466, 0.4578275, 0.40821073],
            "image_std": [0.26862954, 0.26130258, 0.27577711],
            "min_pixels": p.min_pixels,
            "max_pixels": p.max_pixels,
            "patch_size": 14,
            "temporal_patch_size": 2,
            "merge_size": 2,
        },
    )
    _write_weights(tmp, seed, p.hidden, qwen_vl_shapes(vocab, preset))


def _random_tensor(seed: int, name: str, shape: tuple[int, ...], hidden: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(_tensor_seed(seed, name))
    fan_in = int(torch.tensor(shape[1:]).prod()) if len(shape) > 1 else shape[0]
    if name.startswith("visual.") and "norm" not in name and len(shape) > 1:
        return (torch.randn(shape, generator=gen) * (1.5 * fan_in**-0.5)).contiguous()
    return _init_tensor(name, shape, hidden, gen).contiguous()


def _write_weights(tmp: Path, seed: int, hidden: int, shapes: dict[str, tuple[int, ...]]) -> None:
    """One `model.safetensors`, or shards of at most SHARD_BYTES with their index (as published
    checkpoints are), drawing each shard's tensors only when it is written."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = 4 * int(torch.tensor(shape).prod())
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    if len(shards) == 1:
        weights = {name: _random_tensor(seed, name, shapes[name], hidden) for name in shards[0]}
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for index, names in enumerate(shards, start=1):
        file = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        weights = {name: _random_tensor(seed, name, shapes[name], hidden) for name in names}
        save_file(weights, str(tmp / file), metadata={"format": "pt"})
        del weights
        weight_map.update(dict.fromkeys(names, file))
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def cached_qwen_vl_checkpoint(seed: int = 0, preset: str = "tiny") -> Path:
    """Build once per machine, preset and recipe (under the checkpoint cache), then reuse."""
    name = "qwen2_5_vl-tiny" if preset == "tiny" else f"qwen2_5_vl-{preset}"
    target = cache_dir() / f"{name}-seed{seed}-v{FORMAT_VERSION}-{_cache_key()}"
    weights = ("model.safetensors", "model.safetensors.index.json")
    if any((target / file).is_file() for file in weights) and (target / "preprocessor_config.json").is_file():
        return target
    return build_qwen_vl_checkpoint(target, seed, preset)
