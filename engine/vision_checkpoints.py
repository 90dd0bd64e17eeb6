"""Random-weight vision-language checkpoints in Hugging Face's format, for tests and `bench vision`.

An Idefics3 (SmolVLM) folder: `config.json`, `model.safetensors`, a tokenizer (our byte-level BPE plus
the image tokens SmolVLM's has: `<fake_token_around_image>`, `<image>`, `<global-img>`,
`<row_i_col_j>`, `<end_of_utterance>`), SmolVLM's chat template, and `preprocessor_config.json` for
transformers' `Idefics3ImageProcessor`. Presets: `tiny` (tests) and `smolvlm-256m` (SmolVLM-256M's
shape: SmolLM2-135M's decoder behind a SigLIP tower of 12 layers at 512 px, 64 tokens a tile).
Weights are drawn per tensor from (seed, name), scaled as engine/checkpoints.py scales its own so
outputs depend on the image.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from bulkinfer.engine.checkpoints import (
    _cache_key,
    _init_tensor,
    _publish,
    _save_tokenizer,
    _tensor_seed,
    _write_json,
    build_tokenizer,
    cache_dir,
    make_readable,
)

FORMAT_VERSION = 2
ARCHITECTURE = "Idefics3ForConditionalGeneration"
FAKE_IMAGE_TOKEN = "<fake_token_around_image>"
IMAGE_TOKEN = "<image>"
GLOBAL_IMAGE_TOKEN = "<global-img>"
END_OF_UTTERANCE = "<end_of_utterance>"
GRID_TOKENS = tuple(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7))
IMAGE_SPECIAL_TOKENS = (FAKE_IMAGE_TOKEN, IMAGE_TOKEN, END_OF_UTTERANCE, GLOBAL_IMAGE_TOKEN, *GRID_TOKENS)

# SmolVLM's own chat template (HuggingFaceTB/SmolVLM-*-Instruct): content is a list of parts.
SMOLVLM_CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


@dataclass(frozen=True)
class VisionPreset:
    text_hidden: int
    text_layers: int
    text_heads: int
    text_kv_heads: int
    text_intermediate: int
    vocab_base: int  # the BPE's own vocabulary, before the image tokens
    vision_hidden: int
    vision_layers: int
    vision_heads: int
    vision_intermediate: int
    patch_size: int
    tile_size: int  # the tower's image_size, and the processor's max_image_size
    longest_edge: int  # images are first resized so their longest edge is at most this
    scale_factor: int


VISION_PRESETS = {
    "tiny": VisionPreset(64, 2, 4, 2, 128, 512, 32, 2, 2, 64, 8, 32, 64, 2),
    "smolvlm-256m": VisionPreset(576, 30, 9, 3, 1536, 49152, 768, 12, 12, 3072, 16, 512, 2048, 4),
}


def vision_config(preset: str, vocab: int, image_token_id: int) -> dict:
    """The checkpoint's `config.json` (an Idefics3 config as transformers writes it)."""
    p = VISION_PRESETS[preset]
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "idefics3",
        "image_token_id": image_token_id,
        "scale_factor": p.scale_factor,
        "tie_word_embeddings": False,
        "text_config": {
            "model_type": "llama",
            "vocab_size": vocab,
            "hidden_size": p.text_hidden,
            "intermediate_size": p.text_intermediate,
            "num_hidden_layers": p.text_layers,
            "num_attention_heads": p.text_heads,
            "num_key_value_heads": p.text_kv_heads,
            "head_dim": p.text_hidden // p.text_heads,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-5,
            "rope_theta": 100000.0,
            "max_position_embeddings": 8192,
            "tie_word_embeddings": False,
            "bos_token_id": 0,
            "eos_token_id": 1,
            "pad_token_id": 2,
        },
        "vision_config": {
            "model_type": "idefics3_vision",
            "hidden_size": p.vision_hidden,
            "intermediate_size": p.vision_intermediate,
            "num_hidden_layers": p.vision_layers,
            "num_attention_heads": p.vision_heads,
            "num_channels": 3,
            "image_size": p.tile_size,
            "patch_size": p.patch_size,
            "hidden_act": "gelu_pytorch_tanh",
            "layer_norm_eps": 1e-6,
        },
    }


def vision_tensor_shapes(preset: str, vocab: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint by its transformers name."""
    p = VISION_PRESETS[preset]
    h, kv = p.text_hidden, p.text_kv_heads * (p.text_hidden // p.text_heads)
    shapes: dict[str, tuple[int, ...]] = {
        "model.text_model.embed_tokens.weight": (vocab, h),
        "model.text_model.norm.weight": (h,),
        "lm_head.weight": (vocab, h),
    }
    for i in range(p.text_layers):
        pre = f"model.text_model.layers.{i}."
        shapes.update(
            {
                pre + "input_layernorm.weight": (h,),
                pre + "post_attention_layernorm.weight": (h,),
                pre + "self_attn.q_proj.weight": (h, h),
                pre + "self_attn.k_proj.weight": (kv, h),
                pre + "self_attn.v_proj.weight": (kv, h),
                pre + "self_attn.o_proj.weight": (h, h),
                pre + "mlp.gate_proj.weight": (p.text_intermediate, h),
                pre + "mlp.up_proj.weight": (p.text_intermediate, h),
                pre + "mlp.down_proj.weight": (h, p.text_intermediate),
            }
        )
    v, patches = p.vision_hidden, (p.tile_size // p.patch_size) ** 2
    shapes.update(
        {
            "model.vision_model.embeddings.patch_embedding.weight": (v, 3, p.patch_size, p.patch_size),
            "model.vision_model.embeddings.patch_embedding.bias": (v,),
            "model.vision_model.embeddings.position_embedding.weight": (patches, v),
            "model.vision_model.post_layernorm.weight": (v,),
            "model.vision_model.post_layernorm.bias": (v,),
            "model.connector.modality_projection.proj.weight": (h, v * p.scale_factor**2),
        }
    )
    for i in range(p.vision_layers):
        pre = f"model.vision_model.encoder.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            shapes[f"{pre}self_attn.{name}.weight"] = (v, v)
            shapes[f"{pre}self_attn.{name}.bias"] = (v,)
        for norm in ("layer_norm1", "layer_norm2"):
            shapes[f"{pre}{norm}.weight"] = (v,)
            shapes[f"{pre}{norm}.bias"] = (v,)
        shapes.update(
            {
                pre + "mlp.fc1.weight": (p.vision_intermediate, v),
                pre + "mlp.fc1.bias": (p.vision_intermediate,),
                pre + "mlp.fc2.weight": (v, p.vision_intermediate),
                pre + "mlp.fc2.bias": (v,),
            }
        )
    return shapes


def _vision_weights(preset: str, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    p = VISION_PRESETS[preset]
    out = {}
    for name, shape in vision_tensor_shapes(preset, vocab).items():
        gen = torch.Generator().manual_seed(_tensor_seed(seed, name))
        # engine/checkpoints.py's scaling, under the names it knows for embeddings and the LM head.
        known = name.replace("model.text_model.", "model.")
        if "patch_embedding.weight" in name:
            fan_in = 3 * p.patch_size**2
            out[name] = torch.randn(shape, generator=gen) * (1.5 * fan_in**-0.5)
        elif "position_embedding" in name:
            out[name] = torch.randn(shape, generator=gen) * 0.5
        else:
            out[name] = _init_tensor(known, shape, p.text_hidden, gen).contiguous()
    return out


def preprocessor_config(preset: str = "tiny") -> dict:
    """transformers' Idefics3ImageProcessor settings (SmolVLM's, at this preset's sizes)."""
    p = VISION_PRESETS[preset]
    return {
        "image_processor_type": "Idefics3ImageProcessor",
        "processor_class": "Idefics3Processor",
        "do_convert_rgb": True,
        "do_resize": True,
        "size": {"longest_edge": p.longest_edge},
        "resample": 1,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_pad": True,
        "do_image_splitting": True,
        "max_image_size": {"longest_edge": p.tile_size},
    }


def image_seq_len(preset: str = "tiny") -> int:
    p = VISION_PRESETS[preset]
    return (p.tile_size // p.patch_size) ** 2 // p.scale_factor**2


def build_vision_checkpoint(path: str | Path, preset: str = "tiny", seed: int = 0) -> Path:
    """Write the folder at `path` (built beside it, then renamed into place) and return it."""
    p = VISION_PRESETS[preset]

    def write(tmp: Path) -> None:
        tokenizer = save_tokenizer_with(tmp, p.vocab_base, IMAGE_SPECIAL_TOKENS, SMOLVLM_CHAT_TEMPLATE)
        # The BPE may learn fewer merges than asked on a small corpus: the image tokens' ids are the
        # tokenizer's, and the vocabulary at least the preset's (SmolVLM-256M's 49,280).
        vocab = max(len(tokenizer), p.vocab_base + len(IMAGE_SPECIAL_TOKENS))
        _write_json(tmp / "config.json", vision_config(preset, vocab, _token_id(tokenizer, IMAGE_TOKEN)))
        eos = [1, _token_id(tokenizer, END_OF_UTTERANCE)]
        _write_json(tmp / "generation_config.json",
                    {"bos_token_id": 0, "eos_token_id": eos, "pad_token_id": 2})
        _write_json(tmp / "preprocessor_config.json", preprocessor_config(preset))
        _write_json(tmp / "processor_config.json",
                    {"processor_class": "Idefics3Processor", "image_seq_len": image_seq_len(preset)})
        weights = _vision_weights(preset, vocab, seed)
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})

    return build_in_place(path, write)


def build_in_place(path: str | Path, write: Callable[[Path], None]) -> Path:
    """`write` fills a folder beside `path`, which is then renamed into place (a concurrent build of
    the same checkpoint wins or loses whole); returns `path`, resolved."""
    target = Path(path).expanduser().resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    write(tmp)
    make_readable(tmp)
    try:
        _publish(tmp, target, overwrite=False)
    except FileExistsError:  # another process built it first
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def save_tokenizer_with(folder: Path, vocab_base: int, tokens: Sequence[str], template: str) -> Any:
    """Our byte-level BPE of `vocab_base` merges plus `tokens` as special tokens, with `template` as its
    chat template, saved into `folder`; returns the tokenizer."""
    tokenizer = build_tokenizer(vocab_base)
    tokenizer.add_tokens(list(tokens), special_tokens=True)
    tokenizer.chat_template = template
    _save_tokenizer(tokenizer, folder)
    config_path = folder / "tokenizer_config.json"
    _write_json(config_path, {**json.loads(config_path.read_text()), "chat_template": template})
    return tokenizer


def _token_id(tokenizer: object, token: str) -> int:
    return int(tokenizer.convert_tokens_to_ids(token))  # type: ignore[attr-defined]


def cached_vision_checkpoint(preset: str = "tiny", seed: int = 0) -> Path:
    """Build once per machine and recipe (under the checkpoint cache), then reuse."""
    target = cache_dir() / f"idefics3-{preset}-seed{seed}-v{FORMAT_VERSION}-{_cache_key()}"
    if (target / "model.safetensors").is_file() and (target / "preprocessor_config.json").is_file():
        return target
    return build_vision_checkpoint(target, preset, seed)
