"""A random-weight Qwen2.5-VL checkpoint in Hugging Face's format, for tests: config in transformers
5's form, tensors under the published checkpoints' names (`visual.*`, `model.*`), our byte-level BPE
plus Qwen's vision tokens, Qwen2-VL's chat template, and `preprocessor_config.json` for transformers'
`Qwen2VLImageProcessor` (small pictures: 56 x 56 to 112 x 112 pixels)."""

from __future__ import annotations

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
QWEN_VL_TINY = {
    "hidden": 64,
    "layers": 2,
    "heads": 4,
    "kv_heads": 2,
    "intermediate": 128,
    "vocab_base": 512,
    "mrope_section": [2, 3, 3],
    "vision_hidden": 32,
    "vision_depth": 2,
    "vision_heads": 2,
    "vision_intermediate": 64,
    "window_size": 56,
    "min_pixels": 56 * 56,
    "max_pixels": 112 * 112,
}


def qwen_vl_shapes(vocab: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of the tiny Qwen2.5-VL by its published name (`visual.*`, `model.*`)."""
    p = QWEN_VL_TINY
    h, kv, inner = p["hidden"], p["kv_heads"] * (p["hidden"] // p["heads"]), p["intermediate"]
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (vocab, h),
    }
    for i in range(p["layers"]):
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
    v, vi = p["vision_hidden"], p["vision_intermediate"]
    shapes["visual.patch_embed.proj.weight"] = (v, 3, 2, 14, 14)
    for i in range(p["vision_depth"]):
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


def build_qwen_vl_checkpoint(path: str | Path, seed: int = 0) -> Path:
    """A tiny random Qwen2.5-VL folder (config in transformers 5's form, tensors in the published
    checkpoints' names), built beside `path` and renamed into place."""
    return build_in_place(path, lambda tmp: _write(tmp, seed))


def _write(tmp: Path, seed: int) -> None:
    p = QWEN_VL_TINY
    tokenizer = save_tokenizer_with(tmp, p["vocab_base"], QWEN_VL_TOKENS, QWEN_VL_CHAT_TEMPLATE)
    vocab = max(len(tokenizer), p["vocab_base"] + len(QWEN_VL_TOKENS))
    ids = {token: _token_id(tokenizer, token) for token in QWEN_VL_TOKENS}
    _write_json(
        tmp / "config.json",
        {
            "architectures": [QWEN_VL_ARCHITECTURE],
            "model_type": "qwen2_5_vl",
            "tie_word_embeddings": False,
            "image_token_id": ids["<|image_pad|>"],
            "video_token_id": ids["<|video_pad|>"],
            "vision_start_token_id": ids["<|vision_start|>"],
            "vision_end_token_id": ids["<|vision_end|>"],
            "text_config": {
                "model_type": "qwen2_5_vl_text",
                "vocab_size": vocab,
                "hidden_size": p["hidden"],
                "intermediate_size": p["intermediate"],
                "num_hidden_layers": p["layers"],
                "num_attention_heads": p["heads"],
                "num_key_value_heads": p["kv_heads"],
                "hidden_act": "silu",
                "rms_norm_eps": 1e-6,
                "max_position_embeddings": 4096,
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 10000.0,
                    "mrope_section": p["mrope_section"],
                },
                "bos_token_id": 0,
                "eos_token_id": 1,
                "tie_word_embeddings": False,
            },
            "vision_config": {
                "model_type": "qwen2_5_vl_vision",
                "depth": p["vision_depth"],
                "hidden_size": p["vision_hidden"],
                "intermediate_size": p["vision_intermediate"],
                "num_heads": p["vision_heads"],
                "out_hidden_size": p["hidden"],
                "patch_size": 14,
                "spatial_merge_size": 2,
                "temporal_patch_size": 2,
                "window_size": p["window_size"],
                "fullatt_block_indexes": [p["vision_depth"] - 1],
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
            "min_pixels": p["min_pixels"],
            "max_pixels": p["max_pixels"],
            "patch_size": 14,
            "temporal_patch_size": 2,
            "merge_size": 2,
        },
    )
    weights = {}
    for name, shape in qwen_vl_shapes(vocab).items():
        gen = torch.Generator().manual_seed(_tensor_seed(seed, name))
        fan_in = int(torch.tensor(shape[1:]).prod()) if len(shape) > 1 else shape[0]
        weights[name] = (
            torch.randn(shape, generator=gen) * (1.5 * fan_in**-0.5)
            if name.startswith("visual.") and "norm" not in name and len(shape) > 1
            else _init_tensor(name, shape, p["hidden"], gen)
        ).contiguous()
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})


def cached_qwen_vl_checkpoint(seed: int = 0) -> Path:
    target = cache_dir() / f"qwen2_5_vl-tiny-seed{seed}-v{FORMAT_VERSION}-{_cache_key()}"
    if (target / "model.safetensors").is_file() and (target / "preprocessor_config.json").is_file():
        return target
    return build_qwen_vl_checkpoint(target, seed)
