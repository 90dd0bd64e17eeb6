"""Idefics3 / SmolVLM: a SigLIP vision tower, a pixel-shuffle connector, and a Llama decoder.

Each image tile (all tiles are the tower's full size: the processor resizes to multiples of it) goes
through the tower; the connector folds scale_factor² neighbouring patches into one row and projects
it to the decoder's width. The decoder is `LlamaForCausalLM`, with the image rows put in place of the
image tokens' embeddings by the model runner (engine/multimodal/step_embeds.py). Tensor names are
transformers': `model.text_model.*`, `model.vision_model.*`, `model.connector.*`, `lm_head.*`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from bulkinfer.engine.attention import AttentionBackend
from bulkinfer.engine.models.layers import Embedding
from bulkinfer.engine.models.llama import LlamaForCausalLM
from bulkinfer.engine.models.llama_config import LlamaFamilyConfig, UnsupportedModelError
from bulkinfer.engine.models.module_list import ModuleSeq
from bulkinfer.engine.multimodal.inputs import MultiModalItem

TEXT, OURS = "model.text_model.", "model."
# Tiles per encoder call: bounds the tower's activations (a 512 px SigLIP tile is 1,024 patches).
MAX_TILES_PER_CALL = 32


@dataclass(frozen=True)
class VisionTowerConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    num_channels: int = 3

    @staticmethod
    def from_hf_dict(cfg: dict[str, Any]) -> VisionTowerConfig:
        act = cfg.get("hidden_act", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise UnsupportedModelError(f"vision hidden_act {act!r} is not supported "
                                        "(only gelu_pytorch_tanh)")
        return VisionTowerConfig(
            hidden_size=int(cfg.get("hidden_size", 1152)),
            intermediate_size=int(cfg.get("intermediate_size", 3072)),
            num_layers=int(cfg.get("num_hidden_layers", 12)),
            num_heads=int(cfg.get("num_attention_heads", 16)),
            image_size=int(cfg.get("image_size", 224)), patch_size=int(cfg.get("patch_size", 32)),
            layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-6)),
            num_channels=int(cfg.get("num_channels", 3)))

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


@dataclass(frozen=True)
class Idefics3Config(LlamaFamilyConfig):
    vision: VisionTowerConfig | None = None
    scale_factor: int = 2
    image_token_id: int = -1

    @staticmethod
    def from_hf_dict(architecture: str, cfg: dict[str, Any]) -> Idefics3Config:
        text_cfg = dict(cfg.get("text_config") or {})
        text_type = text_cfg.get("model_type", "llama")
        if text_type != "llama":
            raise UnsupportedModelError(f"Idefics3 with a {text_type!r} decoder is not supported "
                                        "(only llama)")
        text_cfg.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
        text = LlamaFamilyConfig.from_hf_dict("LlamaForCausalLM", text_cfg)
        fields = {f.name: getattr(text, f.name) for f in dataclasses.fields(LlamaFamilyConfig)}
        fields.update(architecture=architecture, tie_word_embeddings=bool(cfg.get(
            "tie_word_embeddings", text_cfg["tie_word_embeddings"])))
        return Idefics3Config(**fields, vision=VisionTowerConfig.from_hf_dict(cfg.get("vision_config") or {}),
                              scale_factor=int(cfg.get("scale_factor", 2)),
                              image_token_id=int(cfg["image_token_id"]))


class VisionLayer(nn.Module):
    """Pre-norm transformer layer, bidirectional attention over one tile's patches."""

    def __init__(self, config: VisionTowerConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.num_heads = config.num_heads
        self.layer_norm1 = nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.layer_norm2 = nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.qkv = nn.Linear(h, 3 * h)
        self.out_proj = nn.Linear(h, h)
        self.fc1 = nn.Linear(h, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tiles, patches, width = x.shape
        qkv = self.qkv(self.layer_norm1(x)).view(tiles, patches, 3, self.num_heads, -1)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v)
        x = x + self.out_proj(attended.transpose(1, 2).reshape(tiles, patches, width))
        return x + self.fc2(F.gelu(self.fc1(self.layer_norm2(x)), approximate="tanh"))


class VisionTower(nn.Module):
    """Patch embedding, learned positions, the layers, a final LayerNorm, then the connector."""

    def __init__(self, config: VisionTowerConfig, text_hidden: int, scale_factor: int) -> None:
        super().__init__()
        self.config = config
        self.scale_factor = scale_factor
        self.patch_embedding = nn.Conv2d(config.num_channels, config.hidden_size, config.patch_size,
                                         stride=config.patch_size)
        self.position_embedding = Embedding(config.patches_per_side ** 2, config.hidden_size)
        self.layers: ModuleSeq[VisionLayer] = ModuleSeq(VisionLayer(config) for _ in range(config.num_layers))
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.projection = nn.Linear(config.hidden_size * scale_factor ** 2, text_hidden, bias=False)
        # Not a buffer: the loader builds on the meta device, where a buffer would come back uninitialized.
        self._position_ids: torch.Tensor | None = None

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[tiles, 3, S, S] -> [tiles * rows per tile, text hidden], tile after tile."""
        pixels = pixel_values.to(self.patch_embedding.weight.dtype)
        x = self.patch_embedding(pixels).flatten(2).transpose(1, 2)
        if self._position_ids is None or self._position_ids.device != x.device:
            self._position_ids = full_tile_positions(self.config.patches_per_side).to(x.device)
        x = x + self.position_embedding(self._position_ids)
        for layer in self.layers:
            x = layer(x)
        x = pixel_shuffle(self.post_layernorm(x), self.scale_factor)
        return self.projection(x).reshape(-1, self.projection.out_features)


def full_tile_positions(per_side: int) -> torch.Tensor:
    """Position ids of a full tile's patches, computed as Idefics3's embeddings do (its fractional
    buckets), so a rounding there gives the same ids here."""
    boundaries = torch.arange(1 / per_side, 1.0, 1 / per_side)
    coords = torch.clamp(torch.arange(per_side, dtype=torch.float32) * (1.0 / torch.tensor(float(per_side))),
                         max=1.0 - 1e-6)
    buckets = torch.bucketize(coords, boundaries, right=True)
    return (buckets[:, None] * per_side + buckets[None, :]).reshape(-1)


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """Idefics3's connector: each scale x scale block of patches becomes one row of scale² x width."""
    tiles, seq, width = x.shape
    side = int(seq ** 0.5)
    x = x.reshape(tiles, side, side // scale, width * scale).permute(0, 2, 1, 3)
    x = x.reshape(tiles, side // scale, side // scale, width * scale * scale).permute(0, 2, 1, 3)
    return x.reshape(tiles, seq // scale ** 2, width * scale * scale)


class Idefics3ForConditionalGeneration(LlamaForCausalLM):
    config_class = Idefics3Config
    config: Idefics3Config

    def __init__(self, config: Idefics3Config, backend: AttentionBackend) -> None:
        super().__init__(config, backend)
        assert config.vision is not None
        self.vision_tower = VisionTower(config.vision, config.hidden_size, config.scale_factor)
        self.vision_tower.requires_grad_(False)

    @property
    def image_token_id(self) -> int:
        return self.config.image_token_id

    def embed_images(self, items: Sequence[MultiModalItem], device: torch.device) -> torch.Tensor:
        """The images' encoder rows, one after another, in the decoder's dtype: their tiles run
        MAX_TILES_PER_CALL at a time."""
        tiles = torch.cat([item.pixel_values for item in items])
        return torch.cat([self.vision_tower(tiles[i:i + MAX_TILES_PER_CALL].to(device))
                          for i in range(0, len(tiles), MAX_TILES_PER_CALL)])

    def expected_hf_tensors(self) -> dict[str, tuple[int, ...]]:
        shapes = {_text_name(name): shape for name, shape in super().expected_hf_tensors().items()}
        v = self.vision_tower.config
        h, vision = v.hidden_size, "model.vision_model."
        shapes.update({
            vision + "embeddings.patch_embedding.weight": (h, v.num_channels, v.patch_size, v.patch_size),
            vision + "embeddings.patch_embedding.bias": (h,),
            vision + "embeddings.position_embedding.weight": (v.patches_per_side ** 2, h),
            vision + "post_layernorm.weight": (h,), vision + "post_layernorm.bias": (h,),
            "model.connector.modality_projection.proj.weight":
                tuple(self.vision_tower.projection.weight.shape),
        })
        for i in range(v.num_layers):
            pre = f"{vision}encoder.layers.{i}."
            for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
                shapes[f"{pre}self_attn.{name}.weight"], shapes[f"{pre}self_attn.{name}.bias"] = (h, h), (h,)
            for norm in ("layer_norm1", "layer_norm2"):
                shapes[f"{pre}{norm}.weight"], shapes[f"{pre}{norm}.bias"] = (h,), (h,)
            shapes[pre + "mlp.fc1.weight"] = (v.intermediate_size, h)
            shapes[pre + "mlp.fc1.bias"] = (v.intermediate_size,)
            shapes[pre + "mlp.fc2.weight"], shapes[pre + "mlp.fc2.bias"] = (h, v.intermediate_size), (h,)
        return shapes

    @torch.no_grad()
    def load_hf_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        super().load_hf_tensors({_our_name(name): t for name, t in tensors.items() if not _is_vision(name)})
        tower, vision = self.vision_tower, "model.vision_model."
        tower.patch_embedding.weight.copy_(tensors[vision + "embeddings.patch_embedding.weight"])
        assert tower.patch_embedding.bias is not None
        tower.patch_embedding.bias.copy_(tensors[vision + "embeddings.patch_embedding.bias"])
        tower.position_embedding.weight.copy_(tensors[vision + "embeddings.position_embedding.weight"])
        tower.post_layernorm.weight.copy_(tensors[vision + "post_layernorm.weight"])
        tower.post_layernorm.bias.copy_(tensors[vision + "post_layernorm.bias"])
        tower.projection.weight.copy_(tensors["model.connector.modality_projection.proj.weight"])
        for i, layer in enumerate(tower.layers):
            pre = f"{vision}encoder.layers.{i}."
            qkv = [f"{pre}self_attn.{n}_proj" for n in ("q", "k", "v")]
            layer.qkv.weight.copy_(torch.cat([tensors[n + ".weight"] for n in qkv]))
            layer.qkv.bias.copy_(torch.cat([tensors[n + ".bias"] for n in qkv]))
            for ours, theirs in (("out_proj", "self_attn.out_proj"), ("layer_norm1", "layer_norm1"),
                                 ("layer_norm2", "layer_norm2"), ("fc1", "mlp.fc1"), ("fc2", "mlp.fc2")):
                getattr(layer, ours).weight.copy_(tensors[f"{pre}{theirs}.weight"])
                getattr(layer, ours).bias.copy_(tensors[f"{pre}{theirs}.bias"])


def _is_vision(name: str) -> bool:
    return name.startswith(("model.vision_model.", "model.connector."))


def _text_name(ours: str) -> str:
    return TEXT + ours[len(OURS):] if ours.startswith(OURS) else ours


def _our_name(hf: str) -> str:
    return OURS + hf[len(TEXT):] if hf.startswith(TEXT) else hf
